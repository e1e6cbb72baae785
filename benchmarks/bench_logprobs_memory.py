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
* ``chunked``: ``sequence_logprobs``: the head applied to a chunk of positions at a time under
  checkpointing (its default chunk: chosen from the vocabulary, 32 positions at Qwen3's; ``--chunk-size``
  sets one);
* ``chunked (old)``: the same call with the code of ``--baseline-src`` (e.g. ``/work/main`` before issue 23:
  256 positions, autograd's log-softmax and softmax), run only when that option is given.

The *extra* peak of a path is its peak minus the ``decoder`` peak; the ratio divides it by one ``(1, T, V)``
float32 tensor (issue 12's target for ``chunked``: at most 1/4 at T = 8,192). The time is one forward +
backward of the path (compare the two chunked rows of one run: the machine is shared and noisy).

Measured as in ``bench_memory.py`` (its helpers are reused): glibc serves every block >= 64 KiB by mmap,
so RSS follows live tensors, and the kernel's high-water mark ``VmHWM`` (reset after the set-up) is the
step's peak. A configuration whose expected peak does not fit in ``MemAvailable`` is skipped, not run.

Usage::

    python benchmarks/bench_logprobs_memory.py                 # T = 2,048 and 8,192
    python benchmarks/bench_logprobs_memory.py --contexts 512  # other lengths
    python benchmarks/bench_logprobs_memory.py --baseline-src /work/main --contexts 2048  # old vs new chunk
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _memory as memory
from bench_memory import (  # benchmarks/ is not a package: imported from its folder
    GIB,
    MIB,
    QWEN3_VOCAB_SIZE,
    _configure_malloc,
    _release_and_reset_peak,
    wide_vocab_qwen3,
)

PATHS = ("decoder", "logits", "chunked")
PROMPT_TOKENS = 16
HIDDEN = 64
# Bytes per (T x V) element the logits path was measured to peak at in float32 (bench_memory.py's docstring):
# used only to decide whether a configuration fits in the memory available now.
LOGITS_PATH_BYTES_PER_ELEMENT = 12


def measure(path: str, steps: int, vocab: int, chunk_size: int | None = None) -> dict[str, float]:
    """Peak RSS above the pre-step RSS of one forward + backward of the log-prob loss (in this process)."""
    _configure_malloc()
    import torch

    from trl_sae.generation.capture import logprobs_from_logits, sequence_logprobs
    from trl_sae.generation.inputs import sequence_inputs

    model = wide_vocab_qwen3(vocab, HIDDEN, steps + PROMPT_TOKENS + 1)
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
                chunk = {} if chunk_size is None else {"chunk_size": chunk_size}  # old code: no None
                logprobs, entropy = sequence_logprobs(
                    model,
                    **inputs,
                    num_completion_tokens=steps,
                    temperature=1.0,
                    return_entropy=True,
                    **chunk,
                )
            loss = -(advantages * logprobs).sum() - 0.01 * entropy.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    resettable = _release_and_reset_peak()
    baseline = memory.rss_bytes()
    started = time.perf_counter()
    step()
    seconds = time.perf_counter() - started
    peak = memory.peak_bytes() - baseline
    return {"path": path, "steps": steps, "peak_bytes": peak, "vmhwm": float(resettable), "seconds": seconds}


def run_worker(
    path: str, steps: int, vocab: int, source: str | None = None, chunk_size: int | None = None
) -> dict[str, float] | None:
    """``measure`` in a fresh process (its ``trl_sae`` from ``source`` when given); None (skipped) when the
    expected peak exceeds MemAvailable."""
    available = memory.mem_available()
    needed = steps * vocab * (LOGITS_PATH_BYTES_PER_ELEMENT if path == "logits" else 1) + GIB
    if available is not None and needed > available:
        print(f"skip {path} T={steps}: needs ~{needed / GIB:.1f} GiB, {available / GIB:.1f} GiB available")
        return None
    command = [sys.executable, os.path.abspath(__file__), "--worker", path, "--contexts", str(steps)]
    command += ["--vocab", str(vocab)]
    if chunk_size is not None:
        command += ["--chunk-size", str(chunk_size)]
    return memory.run_worker(command, f"{path} T={steps}", env=memory.with_source(source))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192], help="completion tokens T")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB_SIZE)
    parser.add_argument("--chunk-size", type=int, default=None, help="chunked path's chunk (default: from V)")
    parser.add_argument(
        "--baseline-src", help="a source tree (e.g. /work/main) whose chunked path runs beside"
    )
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="paths to measure")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.contexts[0], args.vocab, args.chunk_size)))
        return
    if memory.status_bytes("VmHWM") is None:
        print("warning: no /proc/self/status VmHWM: peaks include the set-up (ru_maxrss)")
    print(
        f"Peak memory of one update micro-batch (1 x T tokens, V = {args.vocab:,}, hidden {HIDDEN}), CPU float32"
    )
    print(
        "\n| T | path | peak (MiB) | extra over decoder (MiB) | (1, T, V) fp32 (MiB) | extra / (1, T, V) "
        "| time (s) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for steps in args.contexts:
        paths = ["decoder", *(p for p in args.paths if p != "decoder")]  # the reference of every extra
        runs = [(path, path, None) for path in paths]
        if args.baseline_src:  # the old chunked run right before the new one
            runs.insert(
                paths.index("chunked"), ("chunked (old)", "chunked", os.path.abspath(args.baseline_src))
            )
        results = {}
        for label, path, source in runs:
            chunk = args.chunk_size if source is None else None
            results[label] = run_worker(path, steps, args.vocab, source, chunk)
        full = steps * args.vocab * 4
        decoder = results["decoder"]
        for label, _, _ in runs:
            result = results[label]
            if result is None:
                print(f"| {steps:,} | {label} | skipped (memory) | | {full / MIB:,.0f} | | |")
                continue
            extra = result["peak_bytes"] - decoder["peak_bytes"] if decoder and label != "decoder" else None
            extra_cell = f"{extra / MIB:,.0f}" if extra is not None else ""
            ratio_cell = f"{extra / full:.3f}" if extra is not None else ""
            print(
                f"| {steps:,} | {label} | {result['peak_bytes'] / MIB:,.0f} | {extra_cell} | {full / MIB:,.0f} "
                f"| {ratio_cell} | {result['seconds']:.1f} |"
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
