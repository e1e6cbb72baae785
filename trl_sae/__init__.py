"""trl-sae: PPO with Segmental Advantage Estimation (SAE) for LLM reasoning, on Hugging Face TRL."""

import os as _os

# trl-sae subclasses trl.experimental.ppo on purpose (TRL 1.12 is pinned); the warning helps nobody here.
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    adaptive_lambda,
    discounted_reverse_scan,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    mc_advantages,
    register_advantage_estimator,
    sae_advantages,
)
from .config import SAEPPOConfig
from .data import load_math_dataset
from .rewards import compute_rewards, format_reward, math_accuracy
from .rollout import RolloutOutput, forward_logprobs, generate_with_logprobs
from .segmentation import (
    entropy_boundaries,
    probability_boundaries,
    segment_lengths,
    token_boundaries,
    uniform_boundaries,
)
from .trainer import RolloutBatch, SAEPPOTrainer

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "RolloutBatch",
    "RolloutOutput",
    "SAEPPOConfig",
    "SAEPPOTrainer",
    "__version__",
    "adaptive_lambda",
    "compute_rewards",
    "discounted_reverse_scan",
    "entropy_boundaries",
    "format_reward",
    "forward_logprobs",
    "gae_advantages",
    "generate_with_logprobs",
    "get_advantage_estimator",
    "grpo_advantages",
    "load_math_dataset",
    "math_accuracy",
    "mc_advantages",
    "probability_boundaries",
    "register_advantage_estimator",
    "sae_advantages",
    "segment_lengths",
    "token_boundaries",
    "uniform_boundaries",
]
