"""The trainer's rewards from its arguments: the reward functions checked and named, their weights, and the
reward model's weight (the last of ``reward_weights`` when there is one more weight than functions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trl_sae.rewards.protocol import validate_reward_funcs, warn_zero_reward
from trl_sae.trainer.config import SAEPPOConfig

__all__ = ["Rewards", "resolve_rewards"]


@dataclass
class Rewards:
    funcs: list[Any]
    names: list[str]
    weights: torch.Tensor
    model_weight: float


def resolve_rewards(args: SAEPPOConfig, reward_funcs: Any, reward_model: Any) -> Rewards:
    """Check ``reward_funcs`` against ``args.reward_weights`` and split off the reward model's weight; warn
    when nothing scores the completions."""
    if reward_funcs is None and reward_model is None:
        raise ValueError("Pass `reward_funcs` (callables scoring completions) and/or a `reward_model`.")
    funcs = [] if reward_funcs is None else reward_funcs
    weights = args.reward_weights
    num_funcs = len(funcs) if isinstance(funcs, (list, tuple)) else 1
    model_weight = 1.0
    if weights is not None and reward_model is not None and len(weights) == num_funcs + 1:
        weights, model_weight = weights[:-1], float(weights[-1])  # the last weight is the reward model's
    if funcs:
        checked, names, tensor = validate_reward_funcs(funcs, weights)
    else:
        checked, names, tensor = [], [], torch.zeros(0)
    if not checked and reward_model is None:
        warn_zero_reward(
            "`reward_funcs` is empty and there is no `reward_model`, so every completion scores 0"
            + (" apart from missing_eos_penalty" if args.missing_eos_penalty else "")
            + ": the policy has no signal to learn from. Pass reward_funcs=[...] (e.g. [math_accuracy])."
        )
    return Rewards(checked, names, tensor, model_weight)
