"""The built-in reward functions by name, as recipes and the CLI name them (``reward_funcs: [math_accuracy]``)."""

from __future__ import annotations

from trl_sae.rewards.base import RewardFunction
from trl_sae.rewards.code import code_tests
from trl_sae.rewards.format import format_reward
from trl_sae.rewards.math import math_accuracy
from trl_sae.rewards.multiple_choice import multiple_choice_accuracy
from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy
from trl_sae.rewards.science import science_accuracy, stem_accuracy

__all__ = ["REWARD_FUNCTIONS"]

#: Built-in reward functions by name (``reward_funcs=["math_accuracy"]`` in recipes and the CLI).
REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_accuracy": math_accuracy,
    "format_reward": format_reward,
    # reasoning-gym's own verifiers (reasoning-gym is imported only when it scores)
    "reasoning_gym": reasoning_gym_accuracy,
    # STEM: options by letter or text (GPQA), free-form answers with units (SCP-116K), and each row by its kind
    "multiple_choice_accuracy": multiple_choice_accuracy,
    "science_accuracy": science_accuracy,
    "stem_accuracy": stem_accuracy,
    # programs run against the row's tests in a sandbox (trl_sae.rewards.sandbox)
    "code_tests": code_tests,
}
