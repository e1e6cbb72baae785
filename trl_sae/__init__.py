"""trl-sae: PPO with Segmental Advantage Estimation (SAE) for LLM reasoning, on Hugging Face TRL.

Exports load lazily, so ``trl-sae --help`` and the pure-torch math modules do not import TRL,
transformers or bitsandbytes until something needs them.
"""

from __future__ import annotations

import os as _os

from trl_sae import _moved, _quiet
from trl_sae._lazy import lazy_exports

# On TRL 1.12 trl-sae subclasses trl.experimental.ppo on purpose; the warning helps nobody here.
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# Three other libraries' messages that would fill a user's terminal, each dropped by a filter for it alone.
_quiet.install()
# 0.1.0's module paths (trl_sae.advantages, trl_sae.config, ...) keep importing, naming their new place.
_moved.install()

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # pure torch
    "ADVANTAGE_ESTIMATORS": "core.advantages",
    "EstimatorSpec": "core.advantages",
    "adaptive_lambda": "core.advantages",
    "discounted_reverse_scan": "core.advantages",
    "gae_advantages": "core.advantages",
    "get_advantage_estimator": "core.advantages",
    "get_estimator_spec": "core.advantages",
    "grpo_advantages": "core.advantages",
    "mc_advantages": "core.advantages",
    "register_advantage_estimator": "core.advantages",
    "sae_advantages": "core.advantages",
    "SEGMENTERS": "core.segmentation",
    "SegmenterSpec": "core.segmentation",
    "entropy_boundaries": "core.segmentation",
    "get_segmenter": "core.segmentation",
    "get_segmenter_spec": "core.segmentation",
    "probability_boundaries": "core.segmentation",
    "register_segmenter": "core.segmentation",
    "segment_lengths": "core.segmentation",
    "token_boundaries": "core.segmentation",
    "uniform_boundaries": "core.segmentation",
    # transformers / TRL
    "RolloutOutput": "generation.capture",
    "forward_logprobs": "generation.capture",
    "generate_with_logprobs": "generation.capture",
    "logprobs_from_hidden_states": "generation.capture",
    "logprobs_from_logits": "generation.capture",
    "sequence_logprobs": "generation.capture",
    "compute_rewards": "rewards.protocol",
    "format_reward": "rewards.format",
    "math_accuracy": "rewards.math",
    "load_math_dataset": "data",
    "SAEPPOConfig": "trainer.config",
    "RolloutBatch": "trainer.rollout_batch",
    "SAEPPOTrainer": "trainer.sae_ppo_trainer",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
