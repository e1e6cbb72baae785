"""Extra peak memory and time of a whole ``SAEPPOTrainer`` step at Qwen3's vocabulary, two code trees side by side.

One PPO step (rollout, reference/old log-probs, values, advantages, one update) of a tiny Qwen3 body
(hidden 64, one layer) with Qwen3's vocabulary (151,936): one prompt x two completions of exactly ``T``
tokens (no stop token), one PPO epoch, one mini-batch, ``per_device_train_batch_size=1``, full fine-tuning
with a critic built from the policy, ``kl_coef=0``. At this shape the vocabulary dominates: what the step
holds beyond the weights is the log-prob passes' working set, which is what this measures.

The figure is the *extra* peak resident memory of the whole ``trainer.train()`` over the RSS just before it
(optimizer states and gradients included), divided by one ``(1, T, V)`` float32 tensor; the goal of issue 23
is <= 0.25 at T = 2,048. Each measurement runs in a fresh subprocess with the memory helpers of
``bench_memory.py`` (glibc's mmap threshold pinned at 64 KiB, so RSS follows live tensors; the kernel's
``VmHWM`` reset just before ``train()``), and the same subprocess is run with ``--baseline-src`` first on
``PYTHONPATH`` (e.g. ``/work/main``, the code before the change) and with this checkout's code, alternating,
so old and new are compared in one run on a noisy machine: compare the ratios, not absolute seconds.

Usage::

    python benchmarks/bench_step_memory.py --baseline-src /work/main                  # T = 1,024 and 2,048
    python benchmarks/bench_step_memory.py --baseline-src /work/main --contexts 8192  # needs ~3 GiB free
    python benchmarks/bench_step_memory.py --contexts 2048                             # this checkout only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _memory as memory
from bench_memory import (  # benchmarks/ is not a package: imported from its folder
    GIB,
    MIB,
    QWEN3_VOCAB_SIZE,
    _configure_malloc,
    _materialize_weights,
    _quiet_libraries,
    _release_and_reset_peak,
    import_training_stack,
    wide_vocab_qwen3,
)

HIDDEN = 64
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _constant_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    # Rewards do not change memory; a length-independent value keeps the step identical for both trees.
    return [float(len(ids) % 3) for ids in completion_ids]


def build_model_dir(path: str, vocab: int, steps: int) -> None:
    """A randomly initialised tiny Qwen3 body with ``vocab`` tokens and the char tokenizer, saved to ``path``."""
    from trl_sae.demo.tiny import build_char_tokenizer

    wide_vocab_qwen3(vocab, HIDDEN, steps + 64).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)


def measure(model_dir: str, steps: int, threads: int) -> dict[str, float]:
    """Extra peak RSS and wall time of one ``train()`` (one PPO step) in this process."""
    import torch
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    import trl_sae
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer

    torch.set_num_threads(threads)
    with _quiet_libraries(), tempfile.TemporaryDirectory() as output_dir:
        args = SAEPPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=1,  # micro-batches of one completion ...
            gradient_accumulation_steps=2,  # ... two of them: one mini-batch of the two completions
            num_generations=2,
            response_length=steps,
            num_ppo_epochs=1,
            num_mini_batches=1,
            max_steps=1,
            kl_coef=0.0,
            temperature=1.0,
            learning_rate=1e-5,
            critic_learning_rate=1e-5,
            stop_token=None,  # every completion runs the full response_length
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            use_cpu=True,
            seed=0,
        )
        trainer = SAEPPOTrainer(
            model=model_dir,
            reward_funcs=_constant_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["Say vowels:"]}),
            processing_class=build_char_tokenizer(),
        )
        trainer.remove_callback(PrinterCallback)
        _materialize_weights(trainer.model)
        _release_and_reset_peak()
        baseline = memory.rss_bytes()
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        peak = memory.peak_bytes() - baseline
    return {"steps": steps, "peak_bytes": peak, "seconds": seconds, "code": os.path.dirname(trl_sae.__file__)}


def run_worker(source: str, model_dir: str, steps: int, threads: int) -> dict[str, float]:
    """``measure`` in a fresh process whose ``trl_sae`` comes from ``source``."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--model-dir", model_dir]
    command += ["--contexts", str(steps), "--threads", str(threads)]
    return memory.run_worker(command, f"worker ({source}, T={steps})", env=memory.with_source(source))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048], help="completion tokens T")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB_SIZE)
    parser.add_argument("--baseline-src", help="a source tree (e.g. /work/main) to measure beside this one")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per tree (time: median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _configure_malloc()
        import_training_stack()
        print(json.dumps(measure(args.model_dir, args.contexts[0], args.threads)))
        return

    trees = [("new", CHECKOUT)]
    if args.baseline_src:
        trees.insert(0, ("old", os.path.abspath(args.baseline_src)))
    print(
        f"Whole SAEPPOTrainer step (train(), max_steps=1): tiny Qwen3 body (hidden {HIDDEN}, 1 layer), "
        f"V = {args.vocab:,}, 2 completions x T tokens, 1 epoch, 1 mini-batch, micro-batch 1, "
        f"{args.threads} thread(s); trees: " + ", ".join(f"{name} = {path}" for name, path in trees)
    )
    print(
        "\n| T | tree | extra peak (MiB) | (1, T, V) fp32 (MiB) | extra / (1, T, V) | step time (s) | time / old |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for steps in args.contexts:
        full = steps * args.vocab * 4
        available = memory.mem_available()
        if available is not None and full + 2 * GIB > available:
            print(
                f"| {steps:,} | skipped: needs ~{(full + 2 * GIB) / GIB:.1f} GiB, {available / GIB:.1f} free | | | | | |"
            )
            continue
        with tempfile.TemporaryDirectory() as model_dir:
            build_model_dir(model_dir, args.vocab, steps)
            results: dict[str, list[dict]] = {name: [] for name, _ in trees}
            for _ in range(args.repeats):
                for name, source in trees:  # alternate, so slow phases of the machine hit both
                    results[name].append(run_worker(source, model_dir, steps, args.threads))
        old_time = statistics.median(r["seconds"] for r in results["old"]) if "old" in results else None
        for name, _ in trees:
            peak = max(r["peak_bytes"] for r in results[name])
            seconds = statistics.median(r["seconds"] for r in results[name])
            ratio = f"{seconds / old_time:.2f}" if old_time else ""
            print(
                f"| {steps:,} | {name} | {peak / MIB:,.0f} | {full / MIB:,.0f} | {peak / full:.3f} | "
                f"{seconds:.1f} | {ratio} |"
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
