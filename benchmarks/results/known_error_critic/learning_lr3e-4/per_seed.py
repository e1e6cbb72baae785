"""Per-seed final success, collapses and advantage scale of a known_error_critic sweep folder (README tables).

Usage: python per_seed.py <folder> [<folder> ...]  (runs/*.json of every folder, later folders adding seeds)
A run "collapsed" when its final held-out success is 0.05 or less (the warm start is 0.21; see the README).
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

cells: dict[tuple[float, str], dict[int, dict]] = defaultdict(dict)
for folder in sys.argv[1:]:
    for path in sorted(Path(folder, "runs").glob("*.json")):
        payload = json.loads(path.read_text())
        run = payload["result"]
        cells[(payload["sigma"], run["estimator"])][run["seed"]] = run
print(
    "| sigma | estimator | final success per seed | collapsed (<= 0.05) | advantage std (mean of steps, seeds) |"
)
print("|---:|---|---|---:|---:|")
for (sigma, estimator), runs in sorted(cells.items()):
    finals = [runs[s]["eval_success"][-1] for s in sorted(runs)]
    std = np.mean([np.mean(runs[s]["train"]["advantages/std"]) for s in runs])
    collapsed = sum(f <= 0.05 for f in finals)
    per_seed = ", ".join(f"{f:.2f}" for f in finals)
    print(f"| {sigma:g} | {estimator} | {per_seed} | {collapsed} of {len(finals)} | {std:.3f} |")
