"""Peak memory of one update micro-batch's log-prob loss: the model's full logits vs the chunked head.

One micro-batch (one completion of ``T`` tokens after a 16-token prompt) through a Qwen3-shaped model with
Qwen3's vocabulary (151,936) and a small body (hidden 64, one layer), so the ``(1, T, V)`` logits dominate
as they do on a GPU at this vocabulary; forward and backward of the update's loss (log-probs and
entropies, ``-(advantage * logprob).sum() - 0.01 * entropy.sum()``), the embedding/head frozen as under
LoRA and the layer trainable. Three paths, each in a fresh subprocess:

* ``decoder``: the decoder alone with a trivial loss on the completion's hidden states: what every path
  shares (weights, activations, attention);
* ``logits``: the path before issue 12: the model's ``(1, T, V)`` logits (``logits_to_keep = T + 1``)
  reduced by ``logprobs_from_logits`` in checkpointed float32 chunks;
* ``chunked``: ``sequence_logprobs``: the head applied to 256 positions at a time under checkpointing.

The *extra* peak of a path is its peak minus the ``decoder`` peak; the ratio divides it by one ``(1, T, V)``
float32 tensor (the issue's target for ``chunked``: at most 1/4 at T = 8,192).

Measured as in ``bench_memory.py`` (its helpers are reused): glibc serves every block >= 64 KiB by mmap,
so RSS follows live tensors, and the kernel's high-water mark ``VmHWM`` (reset after the set-up) is the
step's peak. A configuration whose expected peak does not fit in ``MemAvailable`` is skipped, not run.

Usage::

    python benchmarks/bench_logprobs_memory.py                 # T = 2,048 and 8,192
    python benchmarks/bench_logprobs_memory.py --contexts 512  # other lengths
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_memory import (  # benchmarks/ is not a package: imported from its folder
    GIB,
    MIB,
    QWEN3_VOCAB_SIZE,
    _configure_malloc,
    _peak_bytes,
    _proc_status_bytes,
    _release_and_reset_peak,
    _rss_bytes,
)

PATHS = ("decoder", "logits", "chunked")
PROMPT_TOKENS = 16
HIDDEN = 64
# Bytes per (T x V) element the logits path was measured to peak at in float32 (bench_memory.py's docstring):
# used only to decide whether a configuration fits in the memory available now.
LOGITS_PATH_BYTES_PER_ELEMENT = 12


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(path: str, steps: int, vocab: int) -> dict[str, float]:
    """Peak RSS above the pre-step RSS of one forward + backward of the log-prob loss (in this process)."""
    _configure_malloc()
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_sae.generation.capture import logprobs_from_logits, sequence_logprobs
    from trl_sae.generation.inputs import sequence_inputs

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=HIDDEN,
        max_position_embeddings=steps + PROMPT_TOKENS + 1,
        tie_word_embeddings=True,  # as Qwen3-0.6B/1.7B/4B
    )
    model = Qwen3ForCausalLM(config)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen, as the base under LoRA
    prompt_ids = torch.randint(0, vocab, (1, PROMPT_TOKENS))
    completion_ids = torch.randint(0, vocab, (1, steps))
    inputs = sequence_inputs(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)
    )
    advantages = torch.randn(1, steps)

    def step() -> None:
        if path == "decoder":
            hidden = model.model(**inputs, use_cache=False).last_hidden_state[:, -(steps + 1) : -1]
            loss = hidden.float().square().mean()
        else:
            if path == "logits":
                logits = model(**inputs, use_cache=False, logits_to_keep=steps + 1).logits[:, :-1]
                logprobs, entropy = logprobs_from_logits(
                    logits, completion_ids, torch.ones_like(completion_ids), 1.0, return_entropy=True
                )
                del logits
            else:
                logprobs, entropy = sequence_logprobs(
                    model, **inputs, num_completion_tokens=steps, temperature=1.0, return_entropy=True
                )
            loss = -(advantages * logprobs).sum() - 0.01 * entropy.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    resettable = _release_and_reset_peak()
    baseline = _rss_bytes()
    step()
    peak = _peak_bytes() - baseline
    return {"path": path, "steps": steps, "peak_bytes": peak, "vmhwm": float(resettable)}


def run_worker(path: str, steps: int, vocab: int) -> dict[str, float] | None:
    """``measure`` in a fresh process; None (skipped) when the expected peak exceeds MemAvailable."""
    available = _mem_available()
    needed = steps * vocab * (LOGITS_PATH_BYTES_PER_ELEMENT if path == "logits" else 1) + GIB
    if available is not None and needed > available:
        print(f"skip {path} T={steps}: needs ~{needed / GIB:.1f} GiB, {available / GIB:.1f} GiB available")
        return None
    command = [sys.executable, os.path.abspath(__file__), "--worker", path, "--contexts", str(steps)]
    command += ["--vocab", str(vocab)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{path} T={steps} failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192], help="completion tokens T")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB_SIZE)
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.contexts[0], args.vocab)))
        return
    if _proc_status_bytes("VmHWM") is None:
        print("warning: no /proc/self/status VmHWM: peaks include the set-up (ru_maxrss)")
    print(
        f"Peak memory of one update micro-batch (1 x T tokens, V = {args.vocab:,}, hidden {HIDDEN}), CPU float32"
    )
    print("\n| T | path | peak (MiB) | extra over decoder (MiB) | (1, T, V) fp32 (MiB) | extra / (1, T, V) |")
    print("|---:|---|---:|---:|---:|---:|")
    for steps in args.contexts:
        results = {path: run_worker(path, steps, args.vocab) for path in PATHS}
        full = steps * args.vocab * 4
        decoder = results["decoder"]
        for path in PATHS:
            result = results[path]
            if result is None:
                print(f"| {steps:,} | {path} | skipped (memory) | | {full / MIB:,.0f} | |")
                continue
            extra = result["peak_bytes"] - decoder["peak_bytes"] if decoder and path != "decoder" else None
            extra_cell = f"{extra / MIB:,.0f}" if extra is not None else ""
            ratio_cell = f"{extra / full:.3f}" if extra is not None else ""
            print(
                f"| {steps:,} | {path} | {result['peak_bytes'] / MIB:,.0f} | {extra_cell} | {full / MIB:,.0f} "
                f"| {ratio_cell} |"
            )


if __name__ == "__main__":
    main()
