"""Advantage-quality analysis: correlation with a Monte-Carlo ``A*``, segment statistics, and figures.

Plotting needs the optional ``plots`` extra (``pip install "trl-sae[plots]"``); matplotlib is imported only
when a plot function is called.
"""

from trl_sae.analysis.correlation import (
    DEFAULT_LAM_GRID,
    DEFAULT_P_GRID,
    BootstrapPearson,
    CorrelationResult,
    CorrelationRow,
    MonteCarloValues,
    SpanRecord,
    correlate_advantages,
    critic_value_fn,
    estimator_advantages,
    monte_carlo_values,
    pearson_with_bootstrap,
    pick_spans,
    sampling_generation_config,
    segment_anchors,
)
from trl_sae.analysis.plots import plot_correlations, plot_segment_stats
from trl_sae.analysis.segstats import (
    DEFAULT_SEGSTATS_P_GRID,
    SegmentStatsRow,
    segment_stats_from_logprobs,
    segment_stats_vs_threshold,
)

__all__ = [
    "DEFAULT_LAM_GRID",
    "DEFAULT_P_GRID",
    "DEFAULT_SEGSTATS_P_GRID",
    "BootstrapPearson",
    "CorrelationResult",
    "CorrelationRow",
    "MonteCarloValues",
    "SegmentStatsRow",
    "SpanRecord",
    "correlate_advantages",
    "critic_value_fn",
    "estimator_advantages",
    "monte_carlo_values",
    "pearson_with_bootstrap",
    "pick_spans",
    "plot_correlations",
    "plot_segment_stats",
    "sampling_generation_config",
    "segment_anchors",
    "segment_stats_from_logprobs",
    "segment_stats_vs_threshold",
]
