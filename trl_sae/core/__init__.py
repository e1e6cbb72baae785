"""The estimator math in pure torch (no TRL or transformers import): advantage estimators behind a
name registry and segmenters. See docs/design.md for the index conventions."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ADVANTAGE_ESTIMATORS": "advantages",
    "adaptive_lambda": "advantages",
    "discounted_reverse_scan": "advantages",
    "gae_advantages": "advantages",
    "get_advantage_estimator": "advantages",
    "grpo_advantages": "advantages",
    "mc_advantages": "advantages",
    "register_advantage_estimator": "advantages",
    "sae_advantages": "advantages",
    "entropy_boundaries": "segmentation",
    "probability_boundaries": "segmentation",
    "segment_lengths": "segmentation",
    "token_boundaries": "segmentation",
    "uniform_boundaries": "segmentation",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
