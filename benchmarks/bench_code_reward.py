"""code_tests on a batch of 64 completions x 10 stdin/stdout tests: sandboxes in parallel against one at a time.

Each completion is a short Python program (a mix of right and wrong ones of the kinds a code model
writes: a sum, a sort, a loop with a dictionary, an answer that is off by one), run by
:func:`trl_sae.rewards.make_code_reward` with ``scoring="fraction"`` so that every test runs. The same
batch goes through:

* ``one after another``: ``num_workers=1``, one sandbox at a time;
* ``pool x N``: ``num_workers=N`` sandboxes at once (default N: what ``code_tests`` uses, the usable CPUs
  divided by ``LOCAL_WORLD_SIZE``, at most 16);
* ``pool x N, bwrap``: the same pool with ``backend="bwrap"`` (each sandbox built by bubblewrap), where
  bubblewrap runs; the last line gives its programs/s against ``pool x N`` (the cost of bwrap).

Each path runs once to warm up (page cache, imports), then ``--repeats`` times (best and mean). Scores must
agree across paths. Needs Linux and root (the sandbox's namespaces and uids).

    python benchmarks/bench_code_reward.py                 # 64 completions x 10 tests
    python benchmarks/bench_code_reward.py --workers 8     # a given pool size
    python benchmarks/bench_code_reward.py --quick         # 16 completions x 4 tests
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from trl_sae.rewards import make_code_reward
from trl_sae.rewards._verify_worker import default_num_workers
from trl_sae.rewards.sandbox import Sandbox

PROGRAMS = [
    "import sys\nnums = list(map(int, sys.stdin.read().split()))\nprint(sum(nums[1:]))\n",
    "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs))\n",
    "import sys\ndata = sys.stdin.read().split()\nprint(sum(int(x) for x in data[1:]) + 1)\n",  # off by one
    "n = int(input())\nxs = sorted(map(int, input().split()))\ntotal = 0\nfor x in xs:\n    total += x\nprint(total)\n",
    "from collections import Counter\nn = int(input())\nc = Counter(map(int, input().split()))\n"
    "print(sum(k * v for k, v in c.items()))\n",
    "n = int(input())\nprint(n)\n",  # wrong
]


def make_batch(size: int, tests: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    inputs, outputs = [], []
    for _ in range(tests):
        xs = [rng.randint(-1000, 1000) for _ in range(rng.randint(1, 50))]
        inputs.append(f"{len(xs)}\n{' '.join(map(str, xs))}\n")
        outputs.append(f"{sum(xs)}\n")
    cell = json.dumps({"inputs": inputs, "outputs": outputs})
    completions = [f"```python\n{PROGRAMS[i % len(PROGRAMS)]}```" for i in range(size)]
    rng.shuffle(completions)
    return completions, [cell] * size


def time_path(label: str, reward, completions: list[str], tests: list[str], repeats: int) -> dict:
    reward(None, completions[:4], None, tests=tests[:4])  # warm-up
    times, scores = [], None
    for _ in range(repeats):
        started = time.monotonic()
        scores = reward(None, completions, None, tests=tests)
        times.append(time.monotonic() - started)
    return {"label": label, "best": min(times), "mean": statistics.mean(times), "scores": scores}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--tests", type=int, default=10)
    parser.add_argument("--workers", type=int, default=None, help="pool size (default: as code_tests)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 completions x 4 tests")
    args = parser.parse_args()
    if sys.platform != "linux" or os.geteuid() != 0:
        sys.exit("bench_code_reward.py needs Linux and root (the sandbox's namespaces and uids).")
    if args.quick:
        args.size, args.tests = 16, 4
    workers = args.workers or default_num_workers()
    completions, tests = make_batch(args.size, args.tests, args.seed)
    print(
        f"{args.size} completions x {args.tests} tests, pool of {workers}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    paths = [
        time_path(
            "one after another",
            make_code_reward(scoring="fraction", num_workers=1),
            completions,
            tests,
            args.repeats,
        ),
        time_path(
            f"pool x {workers}",
            make_code_reward(scoring="fraction", num_workers=workers),
            completions,
            tests,
            args.repeats,
        ),
    ]
    if Sandbox(backend="auto").resolved_backend == "bwrap":
        paths.append(
            time_path(
                f"pool x {workers}, bwrap",
                make_code_reward(scoring="fraction", num_workers=workers, backend="bwrap"),
                completions,
                tests,
                args.repeats,
            )
        )
    else:
        print("(no bwrap line: bubblewrap is not installed or cannot run here)")
    if any(path["scores"] != paths[0]["scores"] for path in paths):
        sys.exit("the paths disagree on the scores")
    base = paths[0]["best"]
    print(f"{'path':<20} {'best s':>8} {'mean s':>8} {'programs/s':>11} {'tests/s':>9} {'speed-up':>9}")
    for path in paths:
        best = path["best"]
        print(
            f"{path['label']:<20} {best:8.2f} {path['mean']:8.2f} {args.size / best:11.1f} "
            f"{args.size * args.tests / best:9.1f} {base / best:8.2f}x"
        )
    if len(paths) == 3:
        ratio = paths[1]["best"] / paths[2]["best"]
        print(f"bwrap against the default backend, same pool: {ratio:.2f}x the programs/s")
    print(
        f"mean score {statistics.mean(paths[0]['scores']):.3f}; load average at the end {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
