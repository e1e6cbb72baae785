"""One row per (pilot, estimator, sigma, seed) of the learn pilots: held-out success curve, per-decision rate."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for name in sys.argv[1:]:
    results = json.loads((HERE / name / "results.json").read_text())
    extra = json.dumps(results["settings"].get("extra") or {})
    for run, sigma in zip(results["runs"], results["run_sigmas"]):
        rates = results["oracle_rates"][f"sigma{sigma:g}-{run['estimator']}-seed{run['seed']}"]
        curve = ", ".join(f"{s}: {v:.2f}" for s, v in zip(run["eval_steps"], run["eval_success"]))
        first, last = sum(rates[:4]) / 4, sum(rates[-4:]) / 4
        print(
            f"| `{name}` | {run['estimator']} | {sigma:g} | {run['seed']} | {results['settings']['learning_rate']:g} "
            f"| `{extra}` | {curve} | {first:.2f} -> {last:.2f} |"
        )
