"""Reward functions for verifiable rewards: the protocol every reward follows (``base``), the weighted sum
and its per-call timeout (``protocol``, which re-exports the protocol), math accuracy graded by math-verify
(``math``; its timeout worker in ``_verify_worker``), format rewards (``format``), reasoning-gym's verifiers
(``reasoning_gym``), multiple-choice options (``multiple_choice``), free-form science answers with units
(``science``, ``units``), programs run against tests (``code``, ``sandbox``) and the built-ins by name
(``registry``)."""

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
    "extract_choice": "multiple_choice",
    "make_math_accuracy": "math",
    "make_multiple_choice_accuracy": "multiple_choice",
    "make_science_accuracy": "science",
    "make_stem_accuracy": "science",
    "math_accuracy": "math",
    "multiple_choice_accuracy": "multiple_choice",
    "reasoning_gym_accuracy": "reasoning_gym",
    "reward_func_name": "protocol",
    "science_accuracy": "science",
    "stem_accuracy": "science",
    "validate_reward_funcs": "protocol",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
