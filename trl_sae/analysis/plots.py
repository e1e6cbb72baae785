"""Figures of the advantage-quality analysis (matplotlib, optional dependency).

Uses matplotlib's object-oriented API with the Agg canvas, never ``pyplot``: nothing changes the global
backend or leaks figures in a notebook or a headless training job.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from trl_sae.analysis.correlation import CorrelationResult, CorrelationRow

__all__ = ["plot_correlations", "plot_segment_stats"]

_FAMILY_COLOURS = {"gae": "#4C72B0", "sae": "#C44E52", "adaptive_lambda": "#55A868"}
_FAMILY_NAMES = {"gae": "GAE", "sae": "SAE", "adaptive_lambda": "adaptive λ"}


def _new_figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            'Plotting needs matplotlib, an optional dependency: pip install "trl-sae[plots]"'
        ) from error
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Any, path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    figure.savefig(path, dpi=150)
    return path


def _reds(shade: float) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["Reds"](shade)


def _parse_setting(setting: str) -> dict[str, float]:
    """``"p=0.2, lam=0.95"`` -> ``{"p": 0.2, "lam": 0.95}``."""
    out = {}
    for part in setting.split(","):
        key, _, value = part.strip().partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def _errors(rows: Sequence[CorrelationRow]) -> list[list[float]]:
    """Asymmetric error bars; 0 where the interval is unknown (NaN) so the bar still draws."""
    low = [r.pearson - r.ci_low if not math.isnan(r.ci_low) else 0.0 for r in rows]
    high = [r.ci_high - r.pearson if not math.isnan(r.ci_high) else 0.0 for r in rows]
    return [low, high]


def plot_correlations(result: CorrelationResult, path: str | os.PathLike[str]) -> str:
    """The paper's Figure 4: correlation of every estimator with ``A*``.

    Left: one bar per estimator setting with its bootstrap confidence interval. Right: GAE's correlation
    as a function of lambda (with its interval as a band), SAE at each ``p`` and adaptive lambda as
    horizontal lines.

    Args:
        result: output of :func:`~trl_sae.analysis.correlate_advantages`.
        path: where the PNG (or any format matplotlib infers from the suffix) is written.

    Returns:
        ``path`` as a string.
    """
    figure = _new_figure(13.0, 4.8)
    left, right = figure.subplots(1, 2, width_ratios=[1.4, 1.0])
    rows = result.rows
    level = result.config.get("confidence", 0.95)

    # Left: bars in table order (GAE grid, SAE grid, adaptive lambda).
    positions = list(range(len(rows)))
    heights = [0.0 if math.isnan(r.pearson) else r.pearson for r in rows]
    colours = [_FAMILY_COLOURS.get(r.estimator, "#8172B3") for r in rows]
    left.bar(positions, heights, color=colours, yerr=_errors(rows), capsize=3, ecolor="black")
    left.set_xticks(
        positions,
        [f"{_FAMILY_NAMES.get(r.estimator, r.estimator)} {r.setting}" for r in rows],
        rotation=45,
        ha="right",
        rotation_mode="anchor",
        fontsize=7,
    )
    left.axhline(0.0, color="black", linewidth=0.6)
    left.set_ylabel("Pearson r with A*")
    left.set_title(f"Correlation with A* ({100 * level:g}% CI, spans resampled)")

    # Right: GAE(lambda) as a curve, every other estimator as a reference line.
    gae = sorted(
        ((_parse_setting(r.setting).get("lam", math.nan), r) for r in rows if r.estimator == "gae"),
        key=lambda item: item[0],
    )
    if gae:
        lams = [lam for lam, _ in gae]
        right.plot(lams, [r.pearson for _, r in gae], "o-", color=_FAMILY_COLOURS["gae"], label="GAE(λ)")
        right.fill_between(
            lams,
            [r.ci_low for _, r in gae],
            [r.ci_high for _, r in gae],
            color=_FAMILY_COLOURS["gae"],
            alpha=0.15,
            linewidth=0,
        )
    others = [r for r in rows if r.estimator != "gae" and not math.isnan(r.pearson)]
    styles = ["--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1))]
    sae_rows = [r for r in others if r.estimator == "sae"]
    for k, r in enumerate(others):
        if r.estimator == "sae":
            # One shade per p, darker for larger p: equal correlations would otherwise hide each other.
            shade = 0.35 + 0.6 * sae_rows.index(r) / max(1, len(sae_rows) - 1)
            colour = _reds(shade)
        else:
            colour = _FAMILY_COLOURS.get(r.estimator, "#8172B3")
        right.axhline(
            r.pearson,
            color=colour,
            linestyle=styles[k % len(styles)],
            linewidth=1.4,
            label=f"{_FAMILY_NAMES.get(r.estimator, r.estimator)} ({r.setting})",
        )
    right.set_xlabel("λ")
    right.set_ylabel("Pearson r with A*")
    right.set_title("GAE(λ) vs SAE")
    right.legend(fontsize=7, loc="best")
    right.grid(alpha=0.3)
    return _save(figure, path)


def _get(row: Any, key: str) -> float:
    return float(row[key] if isinstance(row, Mapping) else getattr(row, key))


def plot_segment_stats(rows: Sequence[Any], path: str | os.PathLike[str]) -> str:
    """Mean segment length and boundaries per completion as functions of ``p`` (the appendix figure).

    Args:
        rows: :class:`~trl_sae.analysis.SegmentStatsRow` objects or dicts with keys ``p``,
            ``mean_segment_length`` and ``boundaries_per_completion``.
        path: output file.

    Returns:
        ``path`` as a string.
    """
    if not rows:
        raise ValueError("`rows` is empty; pass the output of segment_stats_vs_threshold.")
    ordered = sorted(rows, key=lambda r: _get(r, "p"))
    ps = [_get(r, "p") for r in ordered]
    figure = _new_figure(10.0, 4.0)
    left, right = figure.subplots(1, 2)
    left.plot(ps, [_get(r, "mean_segment_length") for r in ordered], "o-", color=_FAMILY_COLOURS["sae"])
    left.set_xlabel("threshold p")
    left.set_ylabel("mean segment length (tokens)")
    left.set_yscale("log")  # lengths grow fast as p -> 0 (the paper's observation)
    left.set_title("Average segment length")
    left.grid(alpha=0.3, which="both")
    right.plot(
        ps, [_get(r, "boundaries_per_completion") for r in ordered], "o-", color=_FAMILY_COLOURS["gae"]
    )
    right.set_xlabel("threshold p")
    right.set_ylabel("boundaries per completion")
    right.set_title("Boundaries per completion")
    right.grid(alpha=0.3)
    return _save(figure, path)
