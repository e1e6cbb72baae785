"""Rollout throughput: the Transformers path (``generate_with_logprobs``) against vLLM, side by side.

Both paths sample the same prompts from the same randomly initialised model, at the trainer's settings
(pure sampling at the given temperature, the sampled tokens' log-probs kept), and never stop early (random
weights would stop at random; a fixed length makes the token counts equal). Reported per path: completions,
generated tokens, seconds (best of ``--repeats`` after one warm-up run), tokens per second, and the ratio to
the Transformers path. vLLM's engine start and first weight push are timed separately (``start_s``), as
they are paid once per run, not per step. ``--check-logprobs`` also reports how far vLLM's log-probs are
from the trainer's teacher-forced ones on the vLLM samples (the ``rollout/logprob_diff_*`` metrics).

Shapes:

* ``tiny``: the tests' vLLM-compatible tiny Qwen3 (hidden 128, 2 layers, head_dim 64, 100-token vocabulary):
  overhead-bound, so it measures plumbing, not speed;
* ``qwen3-0.6b``: Qwen3-0.6B's architecture (hidden 1,024, 28 layers, 16 query / 8 key-value heads of 128,
  vocabulary 151,936) with random weights: the GPU target (64 completions x 2,048 tokens, vLLM >= 5x).

Usage::

    python benchmarks/bench_rollout.py                                      # CPU plumbing: tiny, 16 x 256
    python benchmarks/bench_rollout.py --shape qwen3-0.6b --prompts 8 --generations 8 \\
        --max-new-tokens 2048 --dtype bfloat16                              # the GPU figure
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1},
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151_936,
        "max_position_embeddings": 40_960,
        "rope_theta": 1_000_000.0,
    },
}


def build_model(shape: str, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    """A randomly initialised causal LM of ``shape`` and the character tokenizer (prompts are token ids)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_sae.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    settings = dict(SHAPES[shape])
    settings.setdefault("vocab_size", len(tokenizer))
    settings.setdefault("intermediate_size", settings["hidden_size"] * 2)
    settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    settings.setdefault("max_position_embeddings", 4096)
    config = Qwen3Config(
        **settings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()
    return model, tokenizer


def make_prompts(
    tokenizer: Any, count: int, generations: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` distinct prompts of 16-31 tokens, each repeated ``generations`` times (the trainer's layout)."""
    from trl_sae.generation.inputs import left_pad

    generator = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)
    prompts = []
    for _ in range(count):
        length = int(torch.randint(16, 32, (1,), generator=generator))
        prompts.append(torch.randint(3, vocab, (length,), generator=generator).tolist())
    ids, mask = left_pad([p for p in prompts for _ in range(generations)], tokenizer.pad_token_id)
    return ids.to(device), mask.to(device)


def time_best(run: Any, repeats: int, device: str) -> tuple[float, Any]:
    """One warm-up call, then the best of ``repeats`` timed calls; returns (seconds, last result)."""
    result = run()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = run()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_transformers(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace
) -> dict[str, Any]:
    from trl_sae.generation.capture import generate_with_logprobs, pure_sampling_config

    config = pure_sampling_config(args.temperature, args.max_new_tokens, [], model.config.pad_token_id)
    chunk = args.hf_batch_size or ids.shape[0]

    def run() -> Any:
        outs = [
            generate_with_logprobs(model, ids[i : i + chunk], mask[i : i + chunk], config)
            for i in range(0, ids.shape[0], chunk)
        ]
        return sum(int(out.completion_mask.sum()) for out in outs)

    with torch.no_grad():
        seconds, tokens = time_best(run, args.repeats, args.device)
    return {"path": "transformers generate_with_logprobs", "seconds": seconds, "tokens": tokens}


def run_vllm(
    model: Any, tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace
) -> tuple[dict[str, Any], Any]:
    from accelerate import Accelerator

    from trl_sae.generation.vllm_backend import VLLMRollout

    start = time.perf_counter()
    engine = VLLMRollout(
        model,
        Accelerator(cpu=args.device == "cpu"),
        tokenizer,
        temperature=args.temperature,
        max_completion_length=args.max_new_tokens,
        stop_token_ids=[],
        dtype=str(model.dtype).removeprefix("torch."),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_length=ids.shape[1] + args.max_new_tokens,
    )
    engine.sync_weights()
    start_seconds = time.perf_counter() - start
    calls = iter(range(10**6))

    def run() -> Any:
        return engine.generate(ids, mask, args.generations, seed=next(calls))

    seconds, out = time_best(run, args.repeats, args.device)
    row = {"path": "vLLM (colocated engine)", "seconds": seconds, "tokens": int(out.completion_mask.sum())}
    row["start_s"] = start_seconds
    return row, (engine, out)


def logprob_agreement(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, out: Any, temperature: float
) -> dict:
    from trl_sae.generation.capture import forward_logprobs

    with torch.no_grad():
        mine, _ = forward_logprobs(model, ids, mask, out.completion_ids, out.completion_mask, temperature)
    valid = out.completion_mask.bool()
    diff = (mine.float() - out.logprobs.to(mine.device)).abs()[valid]
    return {"logprob_diff_mean": diff.mean().item(), "logprob_diff_max": diff.max().item()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per path after a warm-up")
    parser.add_argument(
        "--hf-batch-size", type=int, default=None, help="rows per generate call (default all)"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--check-logprobs", action="store_true", help="also report vLLM vs trainer log-probs")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    for name in ("prompts", "generations", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cpu":
        # The CPU engine would otherwise size its KV cache from RAM minus this process's memory.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    dtype = getattr(torch, args.dtype)
    model, tokenizer = build_model(args.shape, dtype, args.device)
    ids, mask = make_prompts(tokenizer, args.prompts, args.generations, args.device)
    print(
        f"{args.shape}, {args.prompts} prompts x {args.generations} completions x {args.max_new_tokens} tokens, "
        f"T={args.temperature}, {args.dtype} on {args.device} ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__}, best of {args.repeats}",
        flush=True,
    )
    rows = [run_transformers(model, ids, mask, args)]
    gc.collect()
    vllm_row, (engine, out) = run_vllm(model, tokenizer, ids, mask, args)
    rows.append(vllm_row)
    if args.check_logprobs:
        vllm_row.update(logprob_agreement(model, ids, mask, out, args.temperature))
    engine.close()
    base = rows[0]["tokens"] / rows[0]["seconds"]
    print(f"{'path':38s} {'tokens':>8s} {'seconds':>9s} {'tokens/s':>10s} {'vs HF':>7s}")
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["ratio"] = row["tokens_per_s"] / base
        print(
            f"{row['path']:38s} {row['tokens']:8d} {row['seconds']:9.3f} {row['tokens_per_s']:10.1f} "
            f"{row['ratio']:6.2f}x"
        )
    print(f"vLLM engine start + first weight push: {vllm_row['start_s']:.1f} s (once per run)")
    if args.check_logprobs:
        print(
            f"vLLM vs trainer log-probs on vLLM's samples: mean |diff| {vllm_row['logprob_diff_mean']:.3g}, "
            f"max {vllm_row['logprob_diff_max']:.3g}"
        )
    results = {
        "command": " ".join(["python", "benchmarks/bench_rollout.py", *(argv or sys.argv[1:])]),
        "rows": rows,
    }
    results["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
