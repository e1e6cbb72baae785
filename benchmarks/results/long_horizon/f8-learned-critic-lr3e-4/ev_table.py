"""Per run: held-out success curve and the learned critic's explained variance (README table, issue 22 part 3).

Usage: python ev_table.py <folder> [warm-up steps]. EV is the trainer's `critic/explained_variance` per step
(values before the step's update, against the step's returns, valid tokens): mean over the value warm-up steps,
over the actor steps, and over the last 8 steps.
"""

import json
import sys
from pathlib import Path

import numpy as np

folder, warmup = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8
print(
    "| estimator | seed | held-out success (step: value) | EV, warm-up steps | EV, actor steps | EV, last 8 steps |"
)
print("|---|---:|---|---:|---:|---:|")
runs = [json.loads(p.read_text()) for p in sorted(folder.glob("runs/*.json"))]
for payload in sorted(runs, key=lambda p: (p["result"]["estimator"] != "sae", p["result"]["seed"])):
    run = payload["result"]
    ev = np.array(run["train"]["critic/explained_variance"])
    curve = ", ".join(f"{s}: {v:.2f}" for s, v in zip(run["eval_steps"], run["eval_success"]))
    print(
        f"| {run['estimator']} | {run['seed']} | {curve} | {ev[:warmup].mean():+.3f} | {ev[warmup:].mean():+.3f} | "
        f"{ev[-8:].mean():+.3f} |"
    )
