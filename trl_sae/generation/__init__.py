"""Rollout generation that captures per-token log-probabilities and entropies, and the update's
log-probabilities computed chunk by chunk."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RolloutOutput": "capture",
    "forward_logprobs": "capture",
    "generate_with_logprobs": "capture",
    "logprobs_from_logits": "capture",
    "model_stop_token_ids": "capture",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
