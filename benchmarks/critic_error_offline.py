"""Offline: what each critic error does to each estimator's gradient signal on the walk task (issue 30).

No model and no training: walks of the exact filler-8 layout (:func:`trl_sae.demo.decision_task.format_walk`,
one token per character, EOS last) are simulated with every decision allowed with probability ``rate``
independently (the deterministic text is copied exactly, as the warm start does at T = 0.6). Where each walk
stands is then known exactly, so are the true value ``V*`` and the true per-token advantage
``A*[t] = r[t] + V*(t + 1) - V*(t)`` (non-zero only at the decision doors reached with a correct prefix). The
critics are :func:`known_error_critic.walk_values` (the sweep's own), the estimators the project's own
(:mod:`trl_sae.core.advantages`, boundaries from :mod:`trl_sae.core.segmentation`).

Measured per critic x estimator, at the doors of decisions 1..8 reached with a correct prefix:

* **signal fraction**: ``(E[A | allowed door] - E[A | forbidden door]) / (the same for A*)``; the policy gradient
  at a door is proportional to it (the door's log-probability gradient times the advantage);
* **SNR**: that difference over the pooled within-door std of ``A``;
* **bias of the bootstrapped part** (Theorem 4.1): ``A - A(V*) + eps_t`` with ``eps = V - V*``, i.e. what the
  critic's error at later states adds, against the uniform segment length ``M``;
* the **ablations** (paper Section 5.3): segmentation by probability (p 0.2) vs newline vs uniform (M 25) vs
  every token (GAE) vs none (MC), and the Pearson correlation with ``A*`` against ``lam`` (Fig. 5b), over every
  valid token and at the doors, ``A*`` from the true decision points (not SAE's own segments).

``python benchmarks/critic_error_offline.py`` writes ``results.json`` and ``results.md`` under ``--output-dir``
(default ``benchmarks/results/critic_error_offline/``) in about a minute of one thread; ``--smoke`` in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import known_error_critic as kec

from trl_sae.core.advantages import gae_advantages, mc_advantages, sae_advantages
from trl_sae.core.segmentation import probability_boundaries, token_boundaries, uniform_boundaries
from trl_sae.demo.decision_task import decision_char_positions, format_walk

_SCRIPT = "benchmarks/critic_error_offline.py"
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results" / "critic_error_offline"
NEWLINE = (
    1  # the simulated token id of "\n" (every other character is 0: only the newline segmenter reads ids)
)


@dataclass
class Settings:
    """What the measurement simulates; saved with the results."""

    num_walks: int = 20_000
    num_decisions: int = 8
    filler_length: int = 8
    n_doors: int = 7
    rates: tuple[float, ...] = (0.84, 0.95)  # the warm start's per-decision rate, and a policy that learned
    stale_rate: float = 0.84  # the stale critic's earlier policy
    critics: tuple[str, ...] = ("exact", "iid0.25", "blind0.5", "blind1", "stale", "constant")
    lam: float = 0.95
    segment_threshold: float = 0.2
    segment_length: int = 25
    theorem_lengths: tuple[int, ...] = (1, 5, 25, 50, 100, 206)
    lam_grid: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
    early_decisions: int = 4  # the "decisions 1..4"
    seed: int = 0


# --------------------------------------------------------------------------------------------------
# Simulated walks
# --------------------------------------------------------------------------------------------------
@dataclass
class Walks:
    """``n`` simulated walks of one layout; per-token tensors are ``(n, T)``, per-decision ``(n, N)``."""

    mask: torch.Tensor
    rewards: torch.Tensor
    ahead: torch.Tensor
    failed: torch.Tensor
    logprobs: torch.Tensor
    token_ids: torch.Tensor
    doors: torch.Tensor  # (N,) token index of each decision door
    allowed: torch.Tensor  # (n, N) the door taken is allowed
    reached: torch.Tensor  # (n, N) the door is written after a correct prefix


def walk_layout(num_decisions: int, filler_length: int) -> tuple[list[int], list[int], int]:
    """Door token offsets, newline token offsets and length (EOS included) of every walk of this layout."""
    text = format_walk(
        "c", "4821", ["a", "b"] * (num_decisions // 2) + ["a"] * (num_decisions % 2), filler_length
    )
    newlines = [i for i, char in enumerate(text) if char == "\n"]
    return decision_char_positions(text), newlines, len(text) + 1


def simulate_walks(settings: Settings, rate: float, generator: torch.Generator) -> Walks:
    """Walks with every decision allowed with probability ``rate``; see the module docstring."""
    doors, newlines, length = walk_layout(settings.num_decisions, settings.filler_length)
    n, width = settings.num_walks, length
    allowed = torch.rand(n, len(doors), generator=generator) < rate
    first_bad = torch.where(~allowed, torch.arange(len(doors)), len(doors)).min(dim=1).values
    reached = torch.arange(len(doors))[None, :] <= first_bad[:, None]
    door_index = torch.tensor(doors)
    positions = torch.arange(width)
    ahead = (door_index[None, :] >= positions[:, None]).sum(dim=1).expand(n, width)
    fail_token = torch.where(first_bad < len(doors), door_index[first_bad.clamp_max(len(doors) - 1)], width)
    failed = positions[None, :] > fail_token[:, None]
    mask = torch.ones(n, width, dtype=torch.bool)
    success = first_bad == len(doors)
    rewards = torch.zeros(n, width)
    rewards[:, -1] = success.float()
    # The sampled door's probability: an allowed one shares ``rate`` with the other allowed doors, the forbidden
    # one has the rest; every other token is copied with probability 1.
    logprobs = torch.zeros(n, width)
    door_logprob = torch.where(
        allowed, torch.log(torch.tensor(rate / (settings.n_doors - 1))), torch.log(torch.tensor(1 - rate))
    )
    logprobs[:, door_index] = door_logprob
    token_ids = torch.zeros(n, width, dtype=torch.long)
    token_ids[:, newlines] = NEWLINE
    return Walks(mask, rewards, ahead.contiguous(), failed, logprobs, token_ids, door_index, allowed, reached)


def true_values(walks: Walks, rate: float) -> torch.Tensor:
    """``V*``: the exact critic of :func:`known_error_critic.walk_values`."""
    return kec.walk_values(walks.ahead, walks.failed, walks.mask, rate)


def true_advantages(walks: Walks, rate: float) -> torch.Tensor:
    """``A*[t] = r[t] + V*(t + 1) - V*(t)`` (one-step TD error of the exact values, ``V*(L) = 0``)."""
    advantages, _ = gae_advantages(walks.rewards, true_values(walks, rate), walks.mask, lam=0.0)
    return advantages


def critic_values(walks: Walks, critic: str, rate: float, settings: Settings, seed: int) -> torch.Tensor:
    """Values of the named critic on these walks (its noise seeded by ``seed``)."""
    error = kec.CriticError.parse(critic)
    return kec.walk_values(
        walks.ahead,
        walks.failed,
        walks.mask,
        rate,
        error,
        old_rate=settings.stale_rate,
        mean_outcome=float(walks.rewards[:, -1].mean()),
        generator=torch.Generator().manual_seed(seed),
    )


# --------------------------------------------------------------------------------------------------
# Estimators and segmentations
# --------------------------------------------------------------------------------------------------
def boundaries(walks: Walks, segmentation: str, settings: Settings) -> torch.Tensor:
    """The project's segmenters on the simulated walks."""
    if segmentation == "probability":
        return probability_boundaries(walks.logprobs, walks.mask, settings.segment_threshold)
    if segmentation == "newline":
        return token_boundaries(walks.token_ids, walks.mask, [NEWLINE])
    if segmentation.startswith("uniform"):
        return uniform_boundaries(walks.mask, int(segmentation.removeprefix("uniform")))
    raise ValueError(f"Unknown segmentation {segmentation!r}.")


def advantages(
    walks: Walks, values: torch.Tensor, estimator: str, lam: float, settings: Settings
) -> torch.Tensor:
    """``gae``, ``mc``, ``sae`` (probability), or ``sae:<segmentation>`` advantages of the walks."""
    if estimator == "gae":
        return gae_advantages(walks.rewards, values, walks.mask, lam=lam)[0]
    if estimator == "mc":
        return mc_advantages(walks.rewards, values, walks.mask)[0]
    segmentation = estimator.partition(":")[2] or "probability"
    cuts = boundaries(walks, segmentation, settings)
    return sae_advantages(walks.rewards, values, walks.mask, cuts, lam=lam)[0]


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------
def door_statistics(adv: torch.Tensor, walks: Walks) -> dict[str, list[float]]:
    """Per decision: ``E[A | allowed] - E[A | forbidden]`` and the pooled within-door std, over the walks that
    reach the door with a correct prefix."""
    at_doors = adv[:, walks.doors]
    difference, spread = [], []
    for j in range(walks.doors.numel()):
        good = walks.reached[:, j] & walks.allowed[:, j]
        bad = walks.reached[:, j] & ~walks.allowed[:, j]
        a, b = at_doors[good, j].double(), at_doors[bad, j].double()
        if a.numel() < 2 or b.numel() < 2:
            difference.append(float("nan"))
            spread.append(float("nan"))
            continue
        pooled = (
            (a.var() * (a.numel() - 1) + b.var() * (b.numel() - 1)) / (a.numel() + b.numel() - 2)
        ).sqrt()
        difference.append(float(a.mean() - b.mean()))
        spread.append(float(pooled))
    return {"difference": difference, "within_std": spread}


def signal_and_snr(
    adv: torch.Tensor, truth: dict[str, list[float]], walks: Walks, early: int
) -> dict[str, Any]:
    """Signal fraction per decision and its range over decisions ``1..early``; SNR mean over those decisions."""
    mine = door_statistics(adv, walks)
    fraction = [m / t for m, t in zip(mine["difference"], truth["difference"])]
    snr = [m / s if s > 0 else float("inf") for m, s in zip(mine["difference"], mine["within_std"])]
    first = fraction[:early]
    return {
        "fraction": fraction,
        "fraction_early_min": min(first),
        "fraction_early_max": max(first),
        "fraction_early_mean": sum(first) / len(first),
        "snr": snr,
        "snr_early_mean": sum(snr[:early]) / early,
    }


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denominator) if denominator > 0 else float("nan")


def correlations(adv: torch.Tensor, truth: torch.Tensor, walks: Walks) -> dict[str, float]:
    """Pearson r with ``A*`` over every valid token and at the reached doors."""
    doors = torch.zeros_like(walks.mask)
    doors[:, walks.doors] = walks.reached
    return {
        "all_tokens": pearson(adv[walks.mask], truth[walks.mask]),
        "doors": pearson(adv[doors], truth[doors]),
    }


def bootstrapped_bias(
    walks: Walks, values: torch.Tensor, exact: torch.Tensor, lengths: Sequence[int], lam: float, early: int
) -> dict[str, dict[str, float]]:
    """Theorem 4.1: ``A - A(V*) + eps_t`` (the part of the bias from the critic's error at later states) under
    uniform segments of length ``M``, mean and mean absolute value at the reached doors of decisions 1..early."""
    eps = values - exact
    out = {}
    reached = walks.reached[:, :early]
    for m in lengths:
        cuts = uniform_boundaries(walks.mask, m)
        a = sae_advantages(walks.rewards, values, walks.mask, cuts, lam=lam)[0]
        a_true = sae_advantages(walks.rewards, exact, walks.mask, cuts, lam=lam)[0]
        part = (a - a_true + eps)[:, walks.doors[:early]][reached].double()
        out[str(m)] = {"mean": float(part.mean()), "mean_abs": float(part.abs().mean())}
    return out


def measure_rate(settings: Settings, rate: float) -> dict[str, Any]:
    """Every measurement at one policy rate."""
    generator = torch.Generator().manual_seed(settings.seed)
    walks = simulate_walks(settings, rate, generator)
    exact = true_values(walks, rate)
    truth_adv = true_advantages(walks, rate)
    truth = door_statistics(truth_adv, walks)
    estimators = {
        "gae": "gae",
        "sae": "sae",
        "mc": "mc",
    }
    ablation = {
        "probability (p 0.2)": "sae:probability",
        "newline": "sae:newline",
        f"uniform (M {settings.segment_length})": f"sae:uniform{settings.segment_length}",
        "every token (GAE)": "gae",
        "none (MC)": "mc",
    }
    out: dict[str, Any] = {"rate": rate, "success": float(walks.rewards[:, -1].mean()), "critics": {}}
    for index, critic in enumerate(settings.critics):
        if critic == "stale" and rate == settings.stale_rate:
            continue  # the earlier policy is this one: stale is exact
        values = critic_values(walks, critic, rate, settings, settings.seed * 1000 + index)
        row: dict[str, Any] = {"estimators": {}, "ablation": {}, "lam_curve": {}}
        for name, estimator in estimators.items():
            adv = advantages(walks, values, estimator, settings.lam, settings)
            row["estimators"][name] = {
                **signal_and_snr(adv, truth, walks, settings.early_decisions),
                "correlation": correlations(adv, truth_adv, walks),
            }
        for name, estimator in ablation.items():
            adv = advantages(walks, values, estimator, settings.lam, settings)
            row["ablation"][name] = {
                **signal_and_snr(adv, truth, walks, settings.early_decisions),
                "correlation": correlations(adv, truth_adv, walks),
            }
        for name in ("gae", "sae"):
            row["lam_curve"][name] = [
                correlations(advantages(walks, values, name, lam, settings), truth_adv, walks)
                for lam in settings.lam_grid
            ]
        row["theorem_4_1"] = bootstrapped_bias(
            walks, values, exact, settings.theorem_lengths, settings.lam, settings.early_decisions
        )
        out["critics"][critic] = row
    return out


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def _range(cell: dict[str, Any]) -> str:
    low, high = cell["fraction_early_min"], cell["fraction_early_max"]
    return f"{low:.2f}" if abs(high - low) < 0.005 else f"{low:.2f}-{high:.2f}"


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    early = s["early_decisions"]
    lines = [
        "# Critic errors offline: gradient signal per estimator (issue 30)",
        "",
        f"{s['num_walks']} simulated walks per rate, filler {s['filler_length']}, {s['num_decisions']} decisions, "
        f"lam {s['lam']:g}, SAE p {s['segment_threshold']:g}; stale critic from rate {s['stale_rate']:g}.",
        "",
    ]
    for block in results["rates"]:
        rate = block["rate"]
        lines += [
            f"## Policy rate {rate:g} (walk success {block['success']:.3f})",
            "",
            f"Signal fraction at decisions 1..{early} (min-max), SNR (mean over decisions 1..{early}):",
            "",
            "| critic | GAE | SAE | MC | SNR GAE | SNR SAE | SNR MC |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for critic, row in block["critics"].items():
            e = row["estimators"]
            lines.append(
                f"| {critic} | {_range(e['gae'])} | {_range(e['sae'])} | {_range(e['mc'])} | "
                f"{e['gae']['snr_early_mean']:.2f} | {e['sae']['snr_early_mean']:.2f} | {e['mc']['snr_early_mean']:.2f} |"
            )
        lengths = s["theorem_lengths"]
        lines += [
            "",
            f"Theorem 4.1: mean |bootstrapped part of the bias| at decisions 1..{early} vs uniform segment length M "
            "(M 1 is GAE; the mean, signed, in brackets):",
            "",
            "| critic | " + " | ".join(f"M {m}" for m in lengths) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for critic, row in block["critics"].items():
            cells = [
                f"{row['theorem_4_1'][str(m)]['mean_abs']:.3f} ({row['theorem_4_1'][str(m)]['mean']:+.3f})"
                for m in lengths
            ]
            lines.append(f"| {critic} | " + " | ".join(cells) + " |")
        names = list(next(iter(block["critics"].values()))["ablation"])
        lines += [
            "",
            "Segmentation ablation (SAE lam 0.95 on each segmentation): signal fraction 1..4 / SNR / r with A* over "
            "all tokens / r at the doors:",
            "",
            "| critic | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for critic, row in block["critics"].items():
            cells = [
                f"{_range(c)} / {c['snr_early_mean']:.2f} / {c['correlation']['all_tokens']:.2f} / "
                f"{c['correlation']['doors']:.2f}"
                for c in row["ablation"].values()
            ]
            lines.append(f"| {critic} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Pearson r with A* vs lam (all tokens; doors in brackets), GAE and SAE (p 0.2):",
            "",
            "| critic | estimator | " + " | ".join(f"{lam:g}" for lam in s["lam_grid"]) + " |",
            "|---|---|" + "---|" * len(s["lam_grid"]),
        ]
        for critic, row in block["critics"].items():
            for name, curve in row["lam_curve"].items():
                cells = [f"{c['all_tokens']:.2f} ({c['doors']:.2f})" for c in curve]
                lines.append(f"| {critic} | {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += common.report_footer(results)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="500 walks, in seconds (not a result)")
    parser.add_argument("--num-walks", type=int, default=None)
    parser.add_argument("--rates", nargs="+", type=float, default=None, help="default: 0.84 0.95")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--num-threads", type=int, default=1)
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    settings = Settings(num_walks=500) if args.smoke else Settings()
    if args.num_walks is not None:
        settings = replace(settings, num_walks=args.num_walks)
    if args.rates is not None:
        settings = replace(settings, rates=tuple(args.rates))
    if settings.num_walks < 2 or not all(0 < r < 1 for r in settings.rates):
        raise SystemExit("--num-walks must be >= 2 and every --rates value in (0, 1).")
    return settings


def run(settings: Settings, args: argparse.Namespace, command: str) -> dict[str, Any]:
    start = time.perf_counter()
    blocks = []
    for rate in settings.rates:
        blocks.append(measure_rate(settings, rate))
        print(f"rate {rate:g} done ({time.perf_counter() - start:.0f} s)", flush=True)
    results = {
        "command": command,
        "environment": common.environment(),
        "settings": asdict(settings),
        "rates": blocks,
        "total_seconds": time.perf_counter() - start,
    }
    common.save_json_atomically(args.output_dir / "results.json", common.finite(results))
    (args.output_dir / "results.md").write_text(markdown(results))
    print(markdown(results), flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return common.run_script(argv, _SCRIPT, parse_args, settings_from_args, run)


if __name__ == "__main__":
    main()
