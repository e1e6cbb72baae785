"""Benchmark the advantage estimators against a TRL-style reverse loop.

Run ``python benchmarks/bench_advantages.py`` (or ``make bench``); ``--quick`` for a smaller run. Prints one
Markdown table row per (B, T): the reverse-loop reference, ``gae_advantages`` and ``sae_advantages``, all
timed in the same run so the ratios compare like with like, plus the effective memory bandwidth of the
estimators (bytes of input and output tensors touched / time).

The reference is the loop TRL's ``PPOTrainer`` runs inline: one Python iteration per token position,
computing ``delta`` inside the loop over a batch column. It implements GAE; an SAE loop would also gather
``boundaries[:, t + 1]`` each step, so reference/SAE is a conservative ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch

from trl_sae.core.advantages import gae_advantages, sae_advantages
from trl_sae.core.segmentation import probability_boundaries

FULL_SHAPES = [(64, 1024), (256, 4096), (512, 8192)]
QUICK_SHAPES = [(16, 256), (64, 1024)]
LAM, GAMMA, THRESHOLD = 0.95, 1.0, 0.2


def reference_gae_loop(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, lam: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-position reverse loop as PPO trainers write it inline (masking, then t = T-1 .. 0)."""
    valid = mask.bool()
    values = values.masked_fill(~valid, 0.0)
    rewards = rewards.masked_fill(~valid, 0.0)
    length = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    reversed_advantages = []
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1).masked_fill(~valid, 0.0)
    return advantages, (advantages + values).masked_fill(~valid, 0.0)


def make_inputs(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 RLVR-like batch: ragged lengths, KL-sized token rewards plus an outcome reward."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    lengths[0] = length  # at least one full-length row, as in any real batch
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = -0.001 * torch.rand(batch, length, generator=g)
    rewards[torch.arange(batch), lengths - 1] += torch.randint(0, 2, (batch,), generator=g).float()
    values = torch.rand(batch, length, generator=g)
    # Uniform token probabilities: P(prob < 0.2) = 20%, about the boundary rate of the paper's p = 0.2.
    logprobs = torch.rand(batch, length, generator=g).clamp_min(1e-12).log()
    boundaries = probability_boundaries(logprobs, mask, threshold=THRESHOLD)
    return {"rewards": rewards, "values": values, "mask": mask, "boundaries": boundaries}


def interleaved_best_times(fns: dict[str, Callable[[], object]], rounds: dict[str, int]) -> dict[str, float]:
    """Best wall time per function over interleaved rounds, after one warm-up call each.

    Interleaving (ref, gae, sae, ref, gae, sae, ...) exposes every function to the same background load,
    and keeping the best call filters the bursts of a shared machine, so the ratios stay comparable.
    """
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for round_index in range(max(rounds.values())):
        for name, fn in fns.items():
            if round_index < rounds[name]:
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def bytes_touched(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and fewer repeats (seconds)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per estimator (best kept)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: every usable core)"
    )
    args = parser.parse_args()

    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    repeats = args.repeats or (5 if args.quick else 15)
    # All the cores this process may use (the container's share, not the host's).
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or usable
    torch.set_num_threads(threads)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"float32, lam={LAM}, gamma={GAMMA}, boundaries: probability < {THRESHOLD}, best of {repeats}"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"1-minute load average before the run: {load:.1f} on {usable} usable cores")
    if load > usable:
        # Threads of a parallel op wait for each other; on a busy machine a descheduled thread stalls the
        # whole op, so the estimators (not the small-op reference loop) lose most.
        print(
            "note: the machine is busy; timings are inflated, rerun when idle (or compare with --threads 1)"
        )
    print()
    print(
        "| B | T | boundary rate | reference loop (ms) | GAE (ms) | SAE (ms) | reference/GAE | reference/SAE "
        "| SAE/GAE | GAE GB/s | SAE GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, length in shapes:
        x = make_inputs(batch, length)
        rewards, values, mask, boundaries = x["rewards"], x["values"], x["mask"], x["boundaries"]

        def run_reference(r=rewards, v=values, m=mask) -> tuple[torch.Tensor, torch.Tensor]:
            return reference_gae_loop(r, v, m, LAM, GAMMA)

        def run_gae(r=rewards, v=values, m=mask) -> tuple[torch.Tensor, torch.Tensor]:
            return gae_advantages(r, v, m, lam=LAM, gamma=GAMMA)

        def run_sae(r=rewards, v=values, m=mask, b=boundaries) -> tuple[torch.Tensor, torch.Tensor]:
            return sae_advantages(r, v, m, b, lam=LAM, gamma=GAMMA)

        # Results first: a fast estimator that is wrong is not worth timing.
        ref_adv, _ = run_reference()
        gae_adv, gae_ret = run_gae()
        sae_adv, sae_ret = run_sae()
        error = (ref_adv - gae_adv).abs().max().item()
        if error > 1e-3:
            raise SystemExit(
                f"gae_advantages disagrees with the reference loop by {error:.2e} at {batch}x{length}"
            )

        # The reference costs about a second per call at the largest shape: time it fewer times there.
        ref_rounds = max(1, repeats // (5 if batch * length >= 512 * 8192 else 3))
        best = interleaved_best_times(
            {"reference": run_reference, "gae": run_gae, "sae": run_sae},
            {"reference": ref_rounds, "gae": repeats, "sae": repeats},
        )
        t_ref, t_gae, t_sae = best["reference"], best["gae"], best["sae"]

        gae_bytes = bytes_touched(rewards, values, mask, gae_adv, gae_ret)
        sae_bytes = bytes_touched(rewards, values, mask, boundaries, sae_adv, sae_ret)
        rate = (boundaries.sum() / mask.sum()).item()
        print(
            f"| {batch} | {length} | {rate:.0%} | {t_ref * 1e3:.1f} | {t_gae * 1e3:.2f} | {t_sae * 1e3:.2f} "
            f"| {t_ref / t_gae:.1f}x | {t_ref / t_sae:.1f}x | {t_sae / t_gae:.2f} "
            f"| {gae_bytes / t_gae / 1e9:.2f} | {sae_bytes / t_sae / 1e9:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
