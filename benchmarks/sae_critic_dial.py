"""Issue 50's secondary outcomes, as registered in benchmarks/experiments/sae-pretrained-critic.md: the
critic-quality dial (SAE minus GAE with the critic not pretrained, the low end, and pretrained, the middle) and
how the critic's explained variance moves during PPO after pretraining.

Reads the run files two ``real_model_gym.py --arms`` sweeps committed (``<folder>/runs/*.json``) and writes one
markdown page:

- per end, SAE minus GAE per seed (held-out greedy accuracy gain, points), its mean and bootstrap 95% interval
  over seeds; and the difference of the two ends per seed (low-end edge minus middle edge) with its interval.
  No test is claimed (the registration's words); an interval that excludes 0 is reported as such.
- per arm and end, the critic's explained variance averaged over the seeds in windows of steps (the
  pretrained critic's starting value is the pretraining's held-out one).

    python benchmarks/sae_critic_dial.py --low benchmarks/results/sae_pretrained_critic/dial_untrained \\
        --middle benchmarks/results/sae_pretrained_critic/primary \\
        --out benchmarks/results/sae_pretrained_critic/dial.md

A seed counts at an end only when both arms finished it there; the difference of ends only on seeds both ends
have (a sweep stopped early is reported on what it has, and the page says how many seeds that is).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["dial_lines", "ev_window_lines", "load_runs", "main"]

SAE, GAE = "sae:sae", "sae:gae"
EV_WINDOWS = ((1, 4), (5, 8), (9, 12), (13, 16), (17, 20), (21, 24))


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """Each finished run of a sweep folder: ``arm``, ``seed``, ``gain`` (last evaluation minus step 0, or
    None without both) and the per-step ``explained_variance`` (``{step: value}``, steps without one left out)."""
    runs = []
    for path in sorted((folder / "runs").glob("*.json")):
        data = json.loads(path.read_text())
        curve = data["curve"]
        base = next((point["accuracy"] for point in curve if point["step"] == 0), None)
        gain = None if base is None or curve[-1]["step"] == 0 else curve[-1]["accuracy"] - base
        diagnostics = data.get("diagnostics") or {}
        ev = {
            step: value
            for step, value in zip(diagnostics.get("step", []), diagnostics.get("explained_variance", []))
            if value is not None
        }
        runs.append({"arm": data["arm"], "seed": data["settings"]["seed"], "gain": gain, "ev": ev})
    return runs


def _edges(runs: list[dict[str, Any]]) -> dict[int, float]:
    """SAE's gain minus GAE's per seed, on the seeds where both have one."""
    gains: dict[str, dict[int, float]] = {}
    for run_ in runs:
        if run_["gain"] is not None:
            gains.setdefault(run_["arm"], {})[run_["seed"]] = run_["gain"]
    sae, gae = gains.get(SAE, {}), gains.get(GAE, {})
    return {seed: sae[seed] - gae[seed] for seed in sorted(sae.keys() & gae.keys())}


def _interval(values: list[float]) -> str:
    from _common import paired_difference

    if not values:
        return "no seeds | n/a"
    summary = paired_difference(values, [0.0] * len(values))
    low, high = summary["bootstrap_ci"]
    interval = "n/a" if math.isnan(low) else f"[{100 * low:+.1f}, {100 * high:+.1f}]"
    return f"{100 * summary['mean']:+.1f} | {interval}"


def dial_lines(low: list[dict[str, Any]], middle: list[dict[str, Any]]) -> list[str]:
    """The dial's table: SAE minus GAE at each end and the low end's edge minus the middle's, per seed, in
    points."""
    ends = {"low (not pretrained)": _edges(low), "middle (pretrained)": _edges(middle)}
    both = sorted(ends["low (not pretrained)"].keys() & ends["middle (pretrained)"].keys())
    ends["low minus middle"] = {
        seed: ends["low (not pretrained)"][seed] - ends["middle (pretrained)"][seed] for seed in both
    }
    seeds = sorted({seed for edges in ends.values() for seed in edges})
    lines = [
        "| SAE - GAE | seeds | mean | 95% bootstrap | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|---:|---:|---|" + "---:|" * len(seeds),
    ]
    for name, edges in ends.items():
        cells = [f"{100 * edges[s]:+.1f}" if s in edges else "" for s in seeds]
        lines.append(
            f"| {name} | {len(edges)} | {_interval(list(edges.values()))} | " + " | ".join(cells) + " |"
        )
    return lines


def ev_window_lines(ends: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per end and critic arm: the critic's explained variance averaged over its steps in each window, then
    over seeds (mean, with the lowest and highest seed's average)."""
    header = " | ".join(f"steps {a}-{b}" for a, b in EV_WINDOWS)
    lines = [f"| end | arm | runs | {header} |", "|---|---|---:|" + "---|" * len(EV_WINDOWS)]
    for end, runs in ends.items():
        for arm in sorted({r["arm"] for r in runs if r["ev"]}):
            arm_runs = [r for r in runs if r["arm"] == arm and r["ev"]]
            cells = []
            for first, last in EV_WINDOWS:
                per_seed = [
                    sum(v for s, v in r["ev"].items() if first <= s <= last)
                    / sum(first <= s <= last for s in r["ev"])
                    for r in arm_runs
                    if any(first <= s <= last for s in r["ev"])
                ]
                cells.append(
                    f"{sum(per_seed) / len(per_seed):.3f} ({min(per_seed):.2f} to {max(per_seed):.2f})"
                    if per_seed
                    else "n/a"
                )
            lines.append(f"| {end} | {arm} | {len(arm_runs)} | " + " | ".join(cells) + " |")
    return lines


def page(low_dir: Path, middle_dir: Path) -> str:
    low, middle = load_runs(low_dir), load_runs(middle_dir)
    return "\n".join(
        [
            "# Issue 50, secondary: the critic-quality dial and the critic during PPO",
            "",
            f"Low end: `{low_dir}` ({len(low)} runs); middle: `{middle_dir}` ({len(middle)} runs). Gains are held-out",
            "greedy accuracy at the last evaluation minus step 0 (the same problems), in points. No test is claimed",
            "(as registered).",
            "",
            *dial_lines(low, middle),
            "",
            "The critic's explained variance during PPO (per run: the mean over the window's steps; then the mean",
            "over runs, with the lowest and highest run):",
            "",
            *ev_window_lines({"low": low, "middle": middle}),
            "",
            f"Written by `python benchmarks/sae_critic_dial.py --low {low_dir} --middle {middle_dir}`.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--low", type=Path, required=True, help="the sweep with the critic not pretrained")
    parser.add_argument("--middle", type=Path, required=True, help="the sweep with the pretrained critic")
    parser.add_argument("--out", type=Path, default=None, help="write the page here (printed otherwise)")
    args = parser.parse_args(argv)
    for name in ("low", "middle"):
        if not (getattr(args, name) / "runs").is_dir():
            parser.error(
                f"--{name} {getattr(args, name)}: no runs/ folder (a real_model_gym.py --arms output)"
            )
    text = page(args.low, args.middle)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
