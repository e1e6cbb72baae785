"""Reward functions for verifiable rewards: the protocol every reward follows, the weighted sum and its
per-call timeout (``protocol``), math accuracy graded by math-verify (``math``; its timeout worker in
``_verify_worker``), format rewards (``format``), reasoning-gym's verifiers (``reasoning_gym``) and the built-ins by name (``registry``)."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "REWARD_FUNCTIONS": "registry",
    "RewardFunction": "protocol",
    "RewardFunctionError": "protocol",
    "RewardTimeoutError": "protocol",
    "code_tests": "code",
    "compute_rewards": "protocol",
    "format_reward": "format",
    "make_code_reward": "code",
    "make_format_reward": "format",
    "make_math_accuracy": "math",
    "math_accuracy": "math",
    "reasoning_gym_accuracy": "reasoning_gym",
    "reward_func_name": "protocol",
    "validate_reward_funcs": "protocol",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
