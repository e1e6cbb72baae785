"""The built-in reward functions by name, as recipes and the CLI name them (``reward_funcs: [math_accuracy]``)."""

from __future__ import annotations

from trl_sae.rewards.format import format_reward
from trl_sae.rewards.math import math_accuracy
from trl_sae.rewards.protocol import RewardFunction

__all__ = ["REWARD_FUNCTIONS"]

#: Built-in reward functions by name (``reward_funcs=["math_accuracy"]`` in recipes and the CLI).
REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_accuracy": math_accuracy,
    "format_reward": format_reward,
}
