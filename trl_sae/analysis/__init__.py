"""Advantage-quality analysis: correlation with a Monte-Carlo ``A*``, segment statistics, and figures.

One module per job: ``stats`` (bootstrap Pearson), ``spans`` (segment anchors, span picking),
``sampling`` (prompt rows, the sampling config, sampled completions, reward scoring), ``monte_carlo``
(``V*`` by continuations), ``correlation`` (the estimators compared, the result types and
:func:`correlate_advantages`), ``segstats`` and ``plots``.

Plotting needs the optional ``plots`` extra (``pip install "trl-sae[plots]"``); matplotlib is imported only
when a plot function is called.
"""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DEFAULT_LAM_GRID": "correlation",
    "DEFAULT_P_GRID": "correlation",
    "CorrelationResult": "correlation",
    "CorrelationRow": "correlation",
    "SpanRecord": "correlation",
    "correlate_advantages": "correlation",
    "critic_value_fn": "correlation",
    "estimator_advantages": "correlation",
    "MonteCarloValues": "monte_carlo",
    "monte_carlo_values": "monte_carlo",
    "plot_correlations": "plots",
    "plot_segment_stats": "plots",
    "sampling_generation_config": "sampling",
    "DEFAULT_SEGSTATS_P_GRID": "segstats",
    "SegmentStatsRow": "segstats",
    "segment_stats_from_logprobs": "segstats",
    "segment_stats_vs_threshold": "segstats",
    "pick_spans": "spans",
    "segment_anchors": "spans",
    "BootstrapPearson": "stats",
    "pearson_with_bootstrap": "stats",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
