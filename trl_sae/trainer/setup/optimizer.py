"""The optimizer's parameter groups: the actor and the critic at their own learning rates."""

from __future__ import annotations

from typing import Any

from torch import nn

from trl_sae.trainer.config import SAEPPOConfig

__all__ = ["optimizer_param_groups"]


def optimizer_param_groups(
    wrapper: nn.Module, decay_names: set[str], args: SAEPPOConfig
) -> list[dict[str, Any]]:
    """Parameter groups: the actor at ``learning_rate`` and the critic at ``critic_learning_rate``, each
    split into weight-decayed (``decay_names``) and not; empty groups are left out.

    Args:
        wrapper: the policy-and-critic module (``actor_parameters()`` / ``critic_parameters()``).
        decay_names: names (in ``wrapper``) of the parameters that take ``args.weight_decay``.
    """
    names = {id(p): n for n, p in wrapper.named_parameters()}
    groups = []
    for params, lr in (
        (wrapper.actor_parameters(), args.learning_rate),
        (wrapper.critic_parameters(), args.critic_learning_rate),
    ):
        for decay in (True, False):
            chosen = [p for p in params if (names[id(p)] in decay_names) == decay]
            if chosen:
                groups.append(
                    {"params": chosen, "lr": lr, "weight_decay": args.weight_decay if decay else 0.0}
                )
    return groups
