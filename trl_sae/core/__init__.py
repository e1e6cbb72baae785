"""The estimator math in pure torch (no TRL or transformers import): advantage estimators (with their
declared capabilities) and segmenters, each behind a name registry. See docs/design.md for the index
conventions."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ADVANTAGE_ESTIMATORS": "advantages",
    "ESTIMATOR_INPUTS": "advantages",
    "EstimatorSpec": "advantages",
    "adaptive_lambda": "advantages",
    "discounted_reverse_scan": "advantages",
    "gae_advantages": "advantages",
    "get_advantage_estimator": "advantages",
    "get_estimator_spec": "advantages",
    "grpo_advantages": "advantages",
    "mc_advantages": "advantages",
    "register_advantage_estimator": "advantages",
    "sae_advantages": "advantages",
    "SEGMENTERS": "segmentation",
    "SEGMENTER_INPUTS": "segmentation",
    "SegmenterSpec": "segmentation",
    "entropy_boundaries": "segmentation",
    "get_segmenter": "segmentation",
    "get_segmenter_spec": "segmentation",
    "probability_boundaries": "segmentation",
    "register_segmenter": "segmentation",
    "segment_lengths": "segmentation",
    "token_boundaries": "segmentation",
    "uniform_boundaries": "segmentation",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
