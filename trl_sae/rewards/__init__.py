"""Reward functions for verifiable rewards: the protocol every reward follows, math accuracy graded
by math-verify, format rewards, and the per-call timeout."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "REWARD_FUNCTIONS": "core",
    "RewardFunction": "core",
    "RewardTimeoutError": "core",
    "compute_rewards": "core",
    "format_reward": "core",
    "make_format_reward": "core",
    "make_math_accuracy": "core",
    "math_accuracy": "core",
    "reward_func_name": "core",
    "validate_reward_funcs": "core",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
