"""The policy + critic modules the PPO update runs through, and merging a LoRA policy into a full model.

The critic follows TRL's convention: a sequence-classification model with one label whose ``score`` head
is applied to every hidden state, so ``values[:, t]`` is read at the position *before* completion token
``t`` (the state ``s_t`` of docs/design.md). Building the critic (and the policy and reference) is in
:mod:`trl_sae.trainer.setup.models`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trl_sae.generation.capture import sequence_logprobs
from trl_sae.generation.inputs import sequence_inputs
from trl_sae.trainer.setup.adapters import adapter_parameters, base_model, sub_state_dict

if TYPE_CHECKING:
    from trl_sae.trainer.critics.shared_prefix import GenerationStates

__all__ = [
    "PolicyAndCritic",
    "SharedBaseCritic",
    "critic_values",
    "disable_checkpointing",
    "enable_checkpointing",
]


def enable_checkpointing(
    model: nn.Module, gradient_checkpointing_kwargs: dict[str, Any] | None = None, **kwargs: Any
) -> None:
    """``model.activation_checkpointing_enable`` (transformers >= 5.23 name), or where a model lacks it the
    deprecated ``gradient_checkpointing_enable`` it replaces (which warns with a FutureWarning)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs
        )


def disable_checkpointing(model: nn.Module) -> None:
    """``model.activation_checkpointing_disable``, or the deprecated ``gradient_checkpointing_disable``."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def _completion_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    num_completion_tokens: int,
) -> torch.Tensor:
    """``(B, T, H)`` last hidden states of the contexts before each of the last ``T`` tokens.

    Runs the transformer body of ``model`` (under any peft wrapper, whose LoRA layers live inside it).
    """
    base = base_model(model)
    backbone = getattr(base, base.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    # Position P-1+t holds the context before completion token t.
    return hidden[:, -num_completion_tokens - 1 : -1]


class PolicyAndCritic(nn.Module):
    """One module holding the policy and the critic, so ``accelerator.prepare`` wraps both at once.

    Its ``forward`` is the only path the PPO update takes, which keeps DDP's gradient hooks in charge of
    both models. Subclasses (e.g. a critic sharing the policy's base) override :meth:`critic_values`.
    """

    def __init__(self, policy: nn.Module, critic: nn.Module | None) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        # Positions per output-head call of policy_logprobs (None: chosen from the vocabulary).
        self.logprob_chunk_size: int | None = None

    @property
    def config(self):
        return base_model(self.policy).config

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    def actor_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters the policy loss updates (learning_rate)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def critic_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters the value loss updates (critic_learning_rate)."""
        return [] if self.critic is None else [p for p in self.critic.parameters() if p.requires_grad]

    def save_critic(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The critic in Transformers format; ``state_dict`` (this wrapper's keys, e.g. gathered from FSDP
        shards) replaces the module's own weights."""
        if self.critic is not None:
            self.critic.save_pretrained(path, state_dict=sub_state_dict(state_dict, "critic."))

    # TRL's unwrap_model_for_generation switches checkpointing off while generating and back on after.
    @property
    def is_gradient_checkpointing(self) -> bool:
        base = base_model(self.policy)
        flag = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.23 name
        return bool(flag if flag is not None else getattr(base, "is_gradient_checkpointing", False))

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        """Checkpointing on the policy and the critic with ``kwargs`` (``gradient_checkpointing_kwargs``,
        ...), or with no ``kwargs`` those of the last call that had some: TRL's
        ``unwrap_model_for_generation`` re-enables it after ``generate`` without any, which would otherwise
        reset a configured ``use_reentrant`` for every update after the first rollout. A keyword given as None
        counts as not given: TRL 1.13+ re-enables with ``gradient_checkpointing_kwargs=None``."""
        given = {key: value for key, value in kwargs.items() if value is not None}
        if given:
            self._checkpointing_kwargs = given
        for module in (self.policy, self.critic):
            if module is not None:
                enable_checkpointing(module, **self.checkpointing_kwargs)

    @property
    def checkpointing_kwargs(self) -> dict[str, Any]:
        """The keywords checkpointing was last enabled with (re-enables reuse them)."""
        return getattr(self, "_checkpointing_kwargs", {})

    def gradient_checkpointing_disable(self) -> None:
        for module in (self.policy, self.critic):
            if module is not None:
                disable_checkpointing(module)

    def policy_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T)`` log-probabilities and entropies of the last ``T`` tokens at ``temperature``.

        The output head runs on chunks of the valid completion positions (checkpointed, see
        :func:`~trl_sae.generation.capture.sequence_logprobs`): no ``(B, T, V)`` logits are held.
        """
        logprobs, entropies = sequence_logprobs(
            self.policy,
            input_ids,
            attention_mask,
            position_ids,
            num_completion_tokens,
            temperature=temperature,
            return_entropy=True,
            chunk_size=self.logprob_chunk_size,
        )
        return logprobs, entropies

    def critic_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> torch.Tensor:
        """``(B, T)`` values of the states before each of the last ``T`` tokens."""
        states = _completion_states(
            self.critic, input_ids, attention_mask, position_ids, num_completion_tokens
        )
        return self.critic.score(states).squeeze(-1).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
        with_policy: bool = True,
        with_critic: bool = True,
        temperature: float = 1.0,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """``((logprobs, entropies), values)`` of the last ``num_completion_tokens`` tokens, each ``(B, T)``
        (None where not asked); the completion is ``input_ids[:, -T:]`` with mask ``attention_mask[:, -T:]``."""
        policy = (
            self.policy_logprobs(input_ids, attention_mask, position_ids, num_completion_tokens, temperature)
            if with_policy
            else None
        )
        values = (
            self.critic_values(input_ids, attention_mask, position_ids, num_completion_tokens)
            if with_critic and self.has_critic
            else None
        )
        return policy, values


class SharedBaseCritic(PolicyAndCritic):
    """Policy and critic as two LoRA adapters on one base model, plus a scalar value head.

    One base model in memory serves the policy (adapter ``policy_adapter``), the reference policy (the
    base with adapters disabled) and the critic (adapter ``critic_adapter`` + ``value_head``). Only the
    active adapter takes part in a forward pass, so the policy loss reaches only the policy adapter and
    the value loss only the critic adapter and the head; the base stays frozen.

    Passes of the base on the same sequences (the update's policy and critic forwards, the rollout's value and
    reference passes) compute the decoder layers before the first adapted layer once
    (:mod:`~trl_sae.trainer.critics.shared_prefix`), unless ``share_prefix`` is False (benchmarks measure the saving
    with it off; the trainer switches it off under FSDP and DeepSpeed, which gather weights per layer).
    That is exact: the replayed layers computed the same numbers in the same full pass.

    With ``reuse_generation_prefix`` (also on by default, and only where ``share_prefix`` is) the rollout's
    value pass (and reference pass) replays those layers from ``generate`` itself when no teacher-forced
    pass runs before it (float32 rollouts with ``generate``, see :meth:`generation_prefix`): ``generate``
    computed them for every position already, so the value pass runs only the adapted layers. This one is
    not bitwise: a cached decoding step rounds unlike one full forward (in float32 the values came within
    3e-7 of the full pass's on the tiny test model). It is on by default because float32 rollouts already
    take their old log-probs from those very decoding steps (the update's first ratio is 1 only to that
    precision), so the old values become no less exact than the old log-probs. Switch it off to compare
    runs bitwise.
    """

    share_prefix: bool = True
    reuse_generation_prefix: bool = True

    def __init__(
        self,
        policy: nn.Module,
        critic_lora_config: Any,
        policy_adapter: str = "default",
        critic_adapter: str = "critic",
    ) -> None:
        super().__init__(policy, critic=None)
        if critic_adapter in policy.peft_config:
            raise ValueError(
                f"The policy already has an adapter named {critic_adapter!r}; pick another name."
            )
        self.policy_adapter = policy_adapter
        self.critic_adapter = critic_adapter
        policy.add_adapter(critic_adapter, critic_lora_config)
        policy.set_adapter(policy_adapter)
        base = base_model(policy)
        self.value_head = nn.Linear(base.config.hidden_size, 1, bias=True)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(base.parameters()).device)
        self._set_adapters_trainable()
        self._prefix_sharing: tuple[tuple[str, ...], Any] | None = None  # (adapter names, PrefixSharing)

    @property
    def has_critic(self) -> bool:
        return True

    def _adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        return adapter_parameters(self.policy, adapter)

    def _set_adapters_trainable(self) -> None:
        # peft's set_adapter freezes every adapter but the active one; both must stay trainable because one
        # optimizer owns both and one backward pass carries both losses.
        self.policy.set_requires_grad([self.policy_adapter, self.critic_adapter], requires_grad=True)

    def actor_parameters(self) -> list[nn.Parameter]:
        return self._adapter_parameters(self.policy_adapter)

    def critic_parameters(self) -> list[nn.Parameter]:
        return self._adapter_parameters(self.critic_adapter) + list(self.value_head.parameters())

    @contextmanager
    def shared_prefix(self, max_recorded: int = 1, max_bytes: int | None = None) -> Iterator[None]:
        """Passes of the base inside on equal inputs compute the layers no adapter touches once (the latest
        ``max_recorded`` passes' recordings, at most ``max_bytes``, are kept for later passes: see
        :meth:`~trl_sae.trainer.critics.shared_prefix.PrefixSharing.scope`).

        Under gradient checkpointing only passes without grad share (the rollout's): a checkpointed pass
        recomputes its layers in the backward, so the update's passes keep their own prefix there.
        """
        from trl_sae.trainer.critics.shared_prefix import PrefixSharing

        if not self.share_prefix:
            yield
            return
        adapters = tuple(sorted(self.policy.peft_config))  # an adapter added later may sit in other layers
        if self._prefix_sharing is None or self._prefix_sharing[0] != adapters:
            self._prefix_sharing = (adapters, PrefixSharing.of(self.policy))
        sharing = self._prefix_sharing[1]
        grad_passes = not self.is_gradient_checkpointing
        with sharing.scope(max_recorded, max_bytes, grad_passes) if sharing is not None else nullcontext():
            yield

    @contextmanager
    def generation_prefix(self) -> Iterator[GenerationStates | None]:
        """Record the unadapted layers' output at every decoder call of a ``generate`` inside, for the later
        passes on the sampled rows: yields the :class:`~trl_sae.trainer.critics.shared_prefix.GenerationStates`, whose
        ``seed`` hands them to :meth:`shared_prefix`'s open scope, or None (nothing recorded) when that scope
        is not open (e.g. ``filter_groups``, whose rounds are re-padded) or ``share_prefix`` or
        ``reuse_generation_prefix`` is off."""
        sharing = self._prefix_sharing[1] if self._prefix_sharing is not None else None
        if not (self.share_prefix and self.reuse_generation_prefix) or sharing is None or not sharing.active:
            yield None
            return
        with sharing.generation() as states:
            yield states

    def forward(
        self, *args: Any, with_policy: bool = True, with_critic: bool = True, **kwargs: Any
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """:meth:`PolicyAndCritic.forward`, with the policy's and critic's passes sharing the unadapted layers."""
        with self.shared_prefix() if with_policy and with_critic else nullcontext():
            return super().forward(*args, with_policy=with_policy, with_critic=with_critic, **kwargs)

    @contextmanager
    def critic_adapter_active(self) -> Iterator[None]:
        """Keep the critic adapter active for a forward *and* its backward pass.

        Under gradient checkpointing the backward pass recomputes layer forwards with whatever adapter is
        active then, so a checkpointed critic pass must run its backward inside this context.
        """
        self.policy.set_adapter(self.critic_adapter)
        self._set_adapters_trainable()
        self._critic_active = True
        try:
            yield
        finally:
            self._critic_active = False
            self.policy.set_adapter(self.policy_adapter)
            self._set_adapters_trainable()

    def critic_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> torch.Tensor:
        if getattr(self, "_critic_active", False):
            states = _completion_states(
                self.policy, input_ids, attention_mask, position_ids, num_completion_tokens
            )
        else:
            states = self._critic_states_keeping_activations(
                input_ids, attention_mask, position_ids, num_completion_tokens
            )
        return self.value_head(states.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def _critic_states_keeping_activations(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> torch.Tensor:
        """Critic pass inside a policy-adapter step: its backward will run with the policy adapter active,
        so it must not be recomputed; checkpointing is switched off for it (activations are kept)."""
        base = base_model(self.policy)
        recompute = self.is_gradient_checkpointing and torch.is_grad_enabled()
        if recompute:
            disable_checkpointing(base)
        self.policy.set_adapter(self.critic_adapter)
        try:
            return _completion_states(
                self.policy, input_ids, attention_mask, position_ids, num_completion_tokens
            )
        finally:
            self.policy.set_adapter(self.policy_adapter)
            self._set_adapters_trainable()
            if recompute:
                enable_checkpointing(base, **self.checkpointing_kwargs)

    def save_critic(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The critic adapter (peft format) and ``value_head.safetensors`` in ``path``; ``state_dict`` (this
        wrapper's keys, e.g. gathered from FSDP shards) replaces the modules' own weights."""
        from safetensors.torch import save_file

        from trl_sae.gguf import peft_save_kwargs

        self.policy.save_pretrained(
            path,
            selected_adapters=[self.critic_adapter],
            state_dict=sub_state_dict(state_dict, "policy."),
            **peft_save_kwargs(self.policy),
        )
        head = sub_state_dict(state_dict, "value_head.") or self.value_head.state_dict()
        state = {k: v.detach().cpu().contiguous() for k, v in head.items()}
        save_file(state, os.path.join(path, "value_head.safetensors"))


@torch.no_grad()
def critic_values(
    module: PolicyAndCritic,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    chunk_size: int,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> torch.Tensor:
    """The critic's value of the state before each completion token, ``(B, T)``, from ``module`` (unwrapped)
    run with ``with_policy=False`` on ``chunk_size`` rows at a time under ``autocast()``; padding positions
    hold whatever the critic reads there (callers mask them)."""
    num_tokens = completion_ids.shape[1]
    values = []
    for start in range(0, prompt_ids.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        inputs = sequence_inputs(
            prompt_ids[part], prompt_mask[part], completion_ids[part], completion_mask[part]
        )
        with autocast():
            _, part_values = module(**inputs, num_completion_tokens=num_tokens, with_policy=False)
        values.append(part_values)
    return torch.cat(values)
