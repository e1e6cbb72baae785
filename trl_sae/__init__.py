"""trl-sae: PPO with Segmental Advantage Estimation (SAE) for LLM reasoning, on Hugging Face TRL.

Exports load lazily, so ``trl-sae --help`` and the pure-torch math modules do not import TRL,
transformers or bitsandbytes until something needs them.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import Any

# trl-sae subclasses trl.experimental.ppo on purpose (TRL 1.12 is pinned); the warning helps nobody here.
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # pure torch
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
    # transformers / TRL
    "RolloutOutput": "rollout",
    "forward_logprobs": "rollout",
    "generate_with_logprobs": "rollout",
    "logprobs_from_logits": "rollout",
    "compute_rewards": "rewards",
    "format_reward": "rewards",
    "math_accuracy": "rewards",
    "load_math_dataset": "data",
    "SAEPPOConfig": "config",
    "RolloutBatch": "trainer",
    "SAEPPOTrainer": "trainer",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trl_sae' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
