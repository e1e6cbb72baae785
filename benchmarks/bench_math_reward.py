"""math_accuracy on a batch of mixed answers: one pass per item (before the batch deadline) against two passes.

A batch of ``--size`` completions, ``--pathological`` of which sympy would evaluate for minutes (huge
powers and factorials, each capped at ``--timeout`` seconds), the rest ordinary answers (right and wrong,
integers, fractions, expressions), shuffled with a fixed seed. The same batch goes through:

* ``signal, one pass``: one item after another in this thread, each under a SIGALRM timer of the full cap
  (what ``math_accuracy`` did in the main thread before the batch deadline);
* ``signal``: the same backend as ``math_accuracy`` runs it now (a short first pass, then the overruns
  retried under one deadline of one cap);
* ``process x N, one pass``: the pool of N workers, each item with the full cap (before the batch deadline;
  N = usable CPUs, at most 16);
* ``process x N``: the pool as ``math_accuracy`` runs it now (the default).

The "one pass" paths call the backends directly (``score_with_alarm``, ``_VerifierPool.score_many``
without a deadline), which is exactly what ``math_accuracy`` did before. Each path is warmed up first
(imports, worker start-up, reported separately), then timed ``--repeats`` times (best and mean). Scores
must agree across paths.

    python benchmarks/bench_math_reward.py                    # 64 answers, 8 pathological, 5 s cap
    python benchmarks/bench_math_reward.py --pathological 0   # 64 ordinary answers: the normal cost
    python benchmarks/bench_math_reward.py --workers 8        # a given pool size
    python benchmarks/bench_math_reward.py --quick            # 16 answers, 2 pathological, 1 s cap
"""

from __future__ import annotations

import argparse
import json
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


class OnePass:
    """``math_accuracy`` before the batch deadline: every item gets the full cap, in one pass."""

    def __init__(self, backend: str, timeout: float, workers: int) -> None:
        self.backend, self.timeout, self.workers = backend, timeout, workers
        self.config = tuple(sorted(make_math_accuracy().scorer_config.items()))

    def __call__(self, prompts, completions: list[str], completion_ids, answer: list[str]) -> list[float]:
        items = list(zip(answer, completions))
        if self.backend == "signal":
            results = _verify_worker.score_with_alarm(
                _verify_worker.cached_scorer(self.config), items, self.timeout
            )
        else:
            pool = _verify_worker.process_pool(json.dumps(dict(self.config), sort_keys=True))
            results, _ = pool.score_many(items, self.timeout, self.workers)
        return [0.0 if r is _verify_worker.TIMEOUT or r is _verify_worker.DIED else r for r in results]


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
    workers = args.workers or _verify_worker.default_num_workers()
    warnings.simplefilter("ignore", RuntimeWarning)  # the one-time "scored 0.0" timeout warning

    completions, golds = make_batch(args.size, args.pathological, args.seed)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.size} answers, {args.pathological} pathological, {args.timeout:g} s cap per item; "
        f"{cpus} usable CPUs, load average {load:.2f} at start"
    )
    paths = [
        ("signal, one pass (before)", OnePass("signal", args.timeout, 1)),
        ("signal (now)", make_math_accuracy(timeout_seconds=args.timeout, backend="signal")),
        (f"process x {workers}, one pass (before)", OnePass("process", args.timeout, workers)),
        (
            f"process x {workers} (now)",
            make_math_accuracy(timeout_seconds=args.timeout, backend="process", num_workers=workers),
        ),
    ]
    results = []
    for label, acc in paths:
        results.append(time_path(label, acc, completions, golds, args.repeats))
        _verify_worker._close_process_verifiers()  # each path starts from no workers
    reference = results[0]["scores"]
    print()
    print("| path | warm-up (s) | batch wall, best (s) | mean (s) | vs one pass | scores agree |")
    print("|---|---|---|---|---|---|")
    for k, r in enumerate(results):
        before = results[k - k % 2]  # each backend's one-pass row
        print(
            f"| {r['label']} | {r['warm_up']:.2f} | {r['best']:.2f} | {r['mean']:.2f} | "
            f"{before['best'] / r['best']:.1f}x | {r['scores'] == reference} |"
        )
    first = _verify_worker.first_pass_seconds(args.timeout)
    one_pass = math.ceil(args.pathological / workers) * args.timeout
    two_pass = math.ceil(args.pathological / workers) * first + (args.timeout if args.pathological else 0)
    print(
        f"\nfloors for the overruns alone: signal one pass {args.pathological} x {args.timeout:g} s = "
        f"{args.pathological * args.timeout:g} s, now {args.pathological} x {first:g} s + "
        f"{args.timeout if args.pathological else 0:g} s; "
        f"pool with {workers} workers, one pass ceil({args.pathological}/{workers}) x {args.timeout:g} s = "
        f"{one_pass:g} s, now ceil({args.pathological}/{workers}) x {first:g} s + "
        f"{args.timeout if args.pathological else 0:g} s = "
        f"{two_pass:g} s. Correct answers: {sum(s == 1.0 for s in reference)}/{args.size}."
    )
    if any(r["scores"] != reference for r in results):
        sys.exit("the paths disagree on the scores")


if __name__ == "__main__":
    main()
