"""trl-sae: PPO with Segmental Advantage Estimation (SAE) for LLM reasoning, on Hugging Face TRL."""

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
from .segmentation import (
    entropy_boundaries,
    probability_boundaries,
    segment_lengths,
    token_boundaries,
    uniform_boundaries,
)

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "__version__",
    "adaptive_lambda",
    "discounted_reverse_scan",
    "entropy_boundaries",
    "gae_advantages",
    "get_advantage_estimator",
    "grpo_advantages",
    "mc_advantages",
    "probability_boundaries",
    "register_advantage_estimator",
    "sae_advantages",
    "segment_lengths",
    "token_boundaries",
    "uniform_boundaries",
]
