"""Critic construction and the policy + critic module the PPO update runs through.

The critic follows TRL's convention: a sequence-classification model with one label whose ``score`` head
is applied to every hidden state, so ``values[:, t]`` is read at the position *before* completion token
``t`` (the state ``s_t`` of DESIGN.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel

__all__ = ["PolicyAndCritic", "build_critic_from_policy", "load_critic"]


def _base_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def build_critic_from_policy(policy: nn.Module) -> PreTrainedModel:
    """A one-label sequence classifier with the policy's architecture, initialised from its backbone.

    The score head starts at zero so the first values are 0 rather than noise; the backbone starts from
    the policy's weights (the usual PPO initialisation when no reward model is available).
    """
    base = _base_model(policy)
    config = copy.deepcopy(base.config)
    config.num_labels = 1
    config.pad_token_id = base.config.pad_token_id
    try:
        critic = AutoModelForSequenceClassification.from_config(config, dtype=base.dtype)
    except ValueError as error:
        raise ValueError(
            f"Cannot build a critic for {type(base).__name__}: transformers has no sequence-classification "
            "variant of this architecture. Pass `value_model=` explicitly (a model or path)."
        ) from error
    source = getattr(base, base.base_model_prefix)
    target = getattr(critic, critic.base_model_prefix)
    target.load_state_dict(source.state_dict())
    with torch.no_grad():
        for parameter in critic.score.parameters():
            parameter.zero_()
    return critic.to(next(base.parameters()).device)


def load_critic(
    value_model: str | PreTrainedModel | None, policy: nn.Module, model_init_kwargs: dict[str, Any] | None
) -> PreTrainedModel:
    """Resolve the trainer's ``value_model`` argument into a critic model.

    Args:
        value_model: ``None`` (built from the policy's weights), a Hub id / local path, or a model.
        policy: the policy (possibly peft-wrapped), used when ``value_model`` is None.
        model_init_kwargs: ``from_pretrained`` keyword arguments for a path.
    """
    if value_model is None:
        return build_critic_from_policy(policy)
    if isinstance(value_model, str):
        return AutoModelForSequenceClassification.from_pretrained(
            value_model, num_labels=1, **(model_init_kwargs or {})
        )
    if not isinstance(value_model, nn.Module) or not hasattr(value_model, "score"):
        raise ValueError(
            "`value_model` must be None, a path, or a sequence-classification model with a `score` head and "
            f"one label; got {type(value_model).__name__}."
        )
    return value_model


class PolicyAndCritic(nn.Module):
    """One module holding the policy and the critic, so ``accelerator.prepare`` wraps both at once.

    Its ``forward`` is the only path the PPO update takes, which keeps DDP's gradient hooks in charge of
    both models. Subclasses (e.g. a critic sharing the policy's base) override :meth:`critic_values`.
    """

    def __init__(self, policy: nn.Module, critic: nn.Module | None) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic

    @property
    def config(self):
        return _base_model(self.policy).config

    # TRL's unwrap_model_for_generation switches checkpointing off while generating and back on after.
    @property
    def is_gradient_checkpointing(self) -> bool:
        base = _base_model(self.policy)
        flag = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.23 name
        return bool(flag if flag is not None else getattr(base, "is_gradient_checkpointing", False))

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        for module in (self.policy, self.critic):
            if module is not None:
                module.gradient_checkpointing_enable(**kwargs)

    def gradient_checkpointing_disable(self) -> None:
        for module in (self.policy, self.critic):
            if module is not None:
                module.gradient_checkpointing_disable()

    def policy_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> torch.Tensor:
        """``(B, T, V)`` logits predicting each of the last ``T`` tokens (no prompt logits computed)."""
        output = self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=num_completion_tokens + 1,
            use_cache=False,
        )
        return output.logits[:, :-1]

    def critic_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> torch.Tensor:
        """``(B, T)`` values of the states before each of the last ``T`` tokens."""
        backbone = getattr(self.critic, self.critic.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # Position P-1+t holds the context before completion token t.
        states = hidden[:, -num_completion_tokens - 1 : -1]
        return self.critic.score(states).squeeze(-1).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
        with_policy: bool = True,
        with_critic: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        logits = (
            self.policy_logits(input_ids, attention_mask, position_ids, num_completion_tokens)
            if with_policy
            else None
        )
        values = (
            self.critic_values(input_ids, attention_mask, position_ids, num_completion_tokens)
            if with_critic and self.critic is not None
            else None
        )
        return logits, values
