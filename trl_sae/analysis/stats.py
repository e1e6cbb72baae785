"""Pearson correlation with a cluster bootstrap: the statistic of the ``A*`` analysis
(:func:`trl_sae.analysis.correlation.correlate_advantages`), whose tokens are grouped by span."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["BootstrapPearson", "pearson_with_bootstrap"]


# --------------------------------------------------------------------------------------------------
# Pearson correlation with a cluster bootstrap
# --------------------------------------------------------------------------------------------------
class BootstrapPearson(NamedTuple):
    """Pearson correlation and the percentile bootstrap confidence interval around it."""

    pearson: float
    ci_low: float
    ci_high: float


def _pearson_from_sums(stats: np.ndarray) -> np.ndarray:
    """Pearson from sufficient statistics ``(..., 6)`` = ``(n, Sx, Sy, Sxx, Syy, Sxy)``; NaN if degenerate."""
    n, sx, sy, sxx, syy, sxy = np.moveaxis(stats, -1, 0)
    cov = n * sxy - sx * sy
    var_x = n * sxx - sx * sx
    var_y = n * syy - sy * sy
    denom = np.sqrt(np.clip(var_x, 0.0, None) * np.clip(var_y, 0.0, None))
    # A relative floor instead of `== 0`: a constant input leaves only rounding noise in var_x.
    scale = np.sqrt(np.abs(n * sxx) * np.abs(n * syy)) + 1e-300
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(denom > 1e-12 * scale, cov / np.where(denom > 0, denom, 1.0), np.nan)
    return np.clip(r, -1.0, 1.0)


def pearson_with_bootstrap(
    x: np.ndarray | Sequence[float] | torch.Tensor,
    y: np.ndarray | Sequence[float] | torch.Tensor,
    groups: np.ndarray | Sequence[int] | torch.Tensor | None = None,
    num_resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> BootstrapPearson:
    """Pearson correlation of ``x`` and ``y`` with a cluster (group) bootstrap confidence interval.

    Each resample draws as many groups as there are, uniformly with replacement, and takes all points of
    each drawn group (a group drawn twice counts twice). Points within a group are not independent (in
    the correlation analysis every token of a span shares the span's ``A*``), so resampling whole groups
    is what gives an honest interval. Computed from per-group sufficient statistics, so a resample costs
    ``O(num_groups)``, not ``O(num_points)``.

    Args:
        x: ``(N,)`` values.
        y: ``(N,)`` values.
        groups: ``(N,)`` group label of each point (any hashable ints); ``None`` makes every point its own
            group (the ordinary bootstrap).
        num_resamples: bootstrap resamples; 0 skips the interval (NaN bounds).
        seed: seed of the resampling generator (the interval is reproducible).
        confidence: two-sided level of the percentile interval, in (0, 1).

    Returns:
        ``BootstrapPearson(pearson, ci_low, ci_high)``; NaN where a variance is zero or ``N < 2``.
    """
    x = np.asarray(torch.as_tensor(x).detach().cpu().double().numpy() if torch.is_tensor(x) else x, float)
    y = np.asarray(torch.as_tensor(y).detach().cpu().double().numpy() if torch.is_tensor(y) else y, float)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"`x` and `y` must be 1-D of the same length; got {x.shape} and {y.shape}.")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence}.")
    if num_resamples < 0:
        raise ValueError(f"`num_resamples` must be >= 0, got {num_resamples}.")
    if groups is None:
        group_index = np.arange(x.shape[0])
    else:
        groups = np.asarray(groups.cpu().numpy() if torch.is_tensor(groups) else groups)
        if groups.shape != x.shape:
            raise ValueError(f"`groups` must have shape {x.shape} like `x`; got {groups.shape}.")
        _, group_index = np.unique(groups, return_inverse=True)
    if x.shape[0] < 2:
        return BootstrapPearson(math.nan, math.nan, math.nan)
    # Centre first: sums of squares of uncentred data lose precision when the mean dwarfs the spread.
    xc, yc = x - x.mean(), y - y.mean()
    num_groups = int(group_index.max()) + 1
    per_point = np.stack([np.ones_like(xc), xc, yc, xc * xc, yc * yc, xc * yc], axis=1)
    group_stats = np.zeros((num_groups, 6))
    np.add.at(group_stats, group_index, per_point)
    pearson = float(_pearson_from_sums(group_stats.sum(axis=0)))
    if num_resamples == 0 or num_groups < 2:
        return BootstrapPearson(pearson, math.nan, math.nan)

    rng = np.random.default_rng(seed)
    samples = np.empty(num_resamples)
    # Chunks bound the (chunk, num_groups) count matrix to a few MB whatever the number of spans.
    chunk = max(1, min(num_resamples, 2_000_000 // num_groups))
    uniform = np.full(num_groups, 1.0 / num_groups)
    for start in range(0, num_resamples, chunk):
        stop = min(num_resamples, start + chunk)
        counts = rng.multinomial(num_groups, uniform, size=stop - start).astype(float)
        samples[start:stop] = _pearson_from_sums(counts @ group_stats)
    if np.isnan(samples).all():
        return BootstrapPearson(pearson, math.nan, math.nan)
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.nanpercentile(samples, [tail, 100.0 - tail])
    return BootstrapPearson(pearson, float(low), float(high))
