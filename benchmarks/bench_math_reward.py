"""math_accuracy on a batch of mixed answers: sequential verification against the worker pool.

A batch of ``--size`` completions, ``--pathological`` of which sympy would evaluate for minutes (huge
powers and factorials, each capped at ``--timeout`` seconds), the rest ordinary answers (right and wrong,
integers, fractions, expressions), shuffled with a fixed seed. Three ways to verify the same batch:

* ``signal``: one item after another in this thread under a SIGALRM timer (what ``math_accuracy`` did in
  the main thread before the pool);
* ``process x 1``: one worker process (what it did outside the main thread before the pool);
* ``process x N``: the pool of N workers (the default now; N = usable CPUs, at most 16).

Each path is warmed up first (imports, worker start-up, reported separately) so the timed call measures
verification alone, then timed ``--repeats`` times (best and mean reported). Scores must agree across paths.

    python benchmarks/bench_math_reward.py                    # 64 answers, 8 pathological, 5 s cap
    python benchmarks/bench_math_reward.py --workers 8        # a given pool size
    python benchmarks/bench_math_reward.py --quick            # 16 answers, 2 pathological, 1 s cap
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
import warnings

from trl_sae.rewards import _verify_worker
from trl_sae.rewards.math import make_math_accuracy

PATHOLOGICAL = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{(10^{10})!}",
    r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{7^{7^{7^{7}}}}",
    r"\boxed{99999999!}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"\boxed{(9^{9^{9}})!}",
]

# (completion, gold): right and wrong answers of the kinds a math dataset has.
NORMAL = [
    (r"Adding up, the total is \boxed{34}.", "34"),
    (r"so \boxed{35}", "34"),
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.4}", r"\frac{1}{2}"),
    (r"\boxed{1+x^2}", "x^2+1"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}"),
    (r"<think>maybe 12? no</think> The answer is \boxed{142}", "142"),
    (r"The final answer is $\frac{3}{4}$.", "0.75"),
    (r"\boxed{(1, 2)}", "(1,2)"),
    ("I do not know.", "7"),
]


def make_batch(size: int, pathological: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    items = [(PATHOLOGICAL[i % len(PATHOLOGICAL)], "34") for i in range(pathological)]
    items += [NORMAL[i % len(NORMAL)] for i in range(size - pathological)]
    rng.shuffle(items)
    return [c for c, _ in items], [g for _, g in items]


def time_path(label: str, acc, completions: list[str], golds: list[str], repeats: int) -> dict:
    started = time.monotonic()
    acc(None, [r"\boxed{1}"] * 64, None, answer=["1"] * 64)  # imports; starts every worker of a pool
    warm_up = time.monotonic() - started
    times, scores = [], None
    for _ in range(repeats):
        started = time.monotonic()
        scores = acc(None, completions, None, answer=golds)
        times.append(time.monotonic() - started)
    return {
        "label": label,
        "warm_up": warm_up,
        "best": min(times),
        "mean": statistics.mean(times),
        "scores": scores,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--pathological", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=5.0, help="per-item cap, seconds (math_accuracy: 5)")
    parser.add_argument("--workers", type=int, default=None, help="pool size (default: as math_accuracy)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 answers, 2 pathological, 1 s cap")
    args = parser.parse_args()
    if args.quick:
        args.size, args.pathological, args.timeout = 16, 2, 1.0
    workers = args.workers or _verify_worker._default_num_workers()
    warnings.simplefilter("ignore", RuntimeWarning)  # the one-time "scored 0.0" timeout warning

    completions, golds = make_batch(args.size, args.pathological, args.seed)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.size} answers, {args.pathological} pathological, {args.timeout:g} s cap per item; "
        f"{cpus} usable CPUs, load average {load:.2f} at start"
    )
    paths = [("signal (sequential, main thread)", dict(backend="signal"))]
    paths.append(("process x 1 (sequential)", dict(backend="process", num_workers=1)))
    paths.append((f"process x {workers} (pool)", dict(backend="process", num_workers=workers)))
    results = []
    for label, options in paths:
        acc = make_math_accuracy(timeout_seconds=args.timeout, **options)
        results.append(time_path(label, acc, completions, golds, args.repeats))
        _verify_worker._close_process_verifiers()  # each path starts from no workers
    reference = results[0]["scores"]
    print()
    print("| path | warm-up (s) | batch wall, best (s) | mean (s) | vs signal | scores agree |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['label']} | {r['warm_up']:.2f} | {r['best']:.2f} | {r['mean']:.2f} | "
            f"{results[0]['best'] / r['best']:.1f}x | {r['scores'] == reference} |"
        )
    bound = math.ceil(args.pathological / workers) * args.timeout
    print(
        f"\nsequential floor: {args.pathological} x {args.timeout:g} s = {args.pathological * args.timeout:g} s; "
        f"pool floor with {workers} workers: ceil({args.pathological}/{workers}) x {args.timeout:g} s = {bound:g} s "
        f"(a worker stuck inside C code, out of its timer's reach, would add a ~1 s restart). "
        f"Correct answers: {sum(s == 1.0 for s in reference)}/{args.size}."
    )
    if any(r["scores"] != reference for r in results):
        sys.exit("the paths disagree on the scores")


if __name__ == "__main__":
    main()
