"""The policy + critic modules the PPO update runs through, and merging a LoRA policy into a full model.

The critic follows TRL's convention: a sequence-classification model with one label whose ``score`` head
is applied to every hidden state, so ``values[:, t]`` is read at the position *before* completion token
``t`` (the state ``s_t`` of docs/design.md). Building the critic (and the policy and reference) is in
:mod:`trl_sae.trainer.models`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel

from trl_sae.generation.capture import sequence_logprobs

if TYPE_CHECKING:
    from trl_sae.trainer.shared_prefix import GenerationStates

__all__ = [
    "PolicyAndCritic",
    "SharedBaseCritic",
    "adapter_merge_problem",
    "adapter_parameters",
    "base_model",
    "merge_adapter_into_full_model",
    "merged_adapter_weights",
    "sub_state_dict",
]


def base_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


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
    (:mod:`~trl_sae.trainer.shared_prefix`), unless ``share_prefix`` is False (benchmarks measure the saving
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
        :meth:`~trl_sae.trainer.shared_prefix.PrefixSharing.scope`).

        Under gradient checkpointing only passes without grad share (the rollout's): a checkpointed pass
        recomputes its layers in the backward, so the update's passes keep their own prefix there.
        """
        from trl_sae.trainer.shared_prefix import PrefixSharing

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
        passes on the sampled rows: yields the :class:`~trl_sae.trainer.shared_prefix.GenerationStates`, whose
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


def sub_state_dict(state_dict: dict[str, torch.Tensor] | None, prefix: str) -> dict[str, torch.Tensor] | None:
    """The entries of ``state_dict`` under ``prefix``, with the prefix removed (None stays None)."""
    if state_dict is None:
        return None
    return {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}


def _full_precision(parameter: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """A parameter of ``module`` in float32, dequantizing bitsandbytes 4-bit (and 8-bit) weights with PEFT's
    ``dequantize_bnb_weight`` (an 8-bit weight's scales live on its module's ``state``)."""
    from peft.utils.integrations import dequantize_bnb_weight, get_bnb_param_type

    if get_bnb_param_type(parameter) == "4bit" and getattr(
        parameter.quant_state, "packing_format_for_cpu", False
    ):
        return _dequantize_cpu_packed_4bit(parameter)
    if get_bnb_param_type(parameter):
        return dequantize_bnb_weight(parameter, state=getattr(module, "state", None)).float()
    # copy=True: .float() on a float32 tensor returns the same storage, and adding deltas to it would
    # silently change the trained model.
    return parameter.detach().to(torch.float32, copy=True)


def _dequantize_cpu_packed_4bit(parameter: torch.Tensor) -> torch.Tensor:
    """A 4-bit weight that bitsandbytes repacked for its CPU kernel, in float32, leaving it as it is.

    On a CPU with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad (a rollout, a recompute)
    repacks the weight in place into a kernel layout with a transposed bf16 ``absmax``; the ordinary
    dequantization then reads garbage (measured: relative error 1.44 instead of 4-bit's 0.09). bitsandbytes'
    own inverse is used on a copy of the state, keeping the exact absmax the kernel computes with.
    """
    import copy

    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse, dequantize_4bit

    state = copy.copy(parameter.quant_state)  # the inverse reassigns fields of the state it is given
    absmax = state.absmax.T.reshape(-1).float()
    state.original_nested = False  # do not re-quantize absmax: keep the values the kernel uses
    data, state = _convert_weight_packed_for_cpu_inverse(parameter.data, state)
    state.absmax, state.nested, state.dtype = absmax, False, torch.float32
    return dequantize_4bit(data, state).float()


def _adapter_weight_dicts(module: nn.Module) -> Iterator[nn.ModuleDict | nn.ParameterDict]:
    """The per-adapter containers of a PEFT layer: ``{adapter name: weights}`` for every attribute the layer
    declares as holding adapter weights (``adapter_layer_names`` and ``other_param_names`` of a tuner
    layer, ``modules_to_save`` of a ``ModulesToSaveWrapper``), as PEFT itself walks them."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, BaseTunerLayer):
        names = (*module.adapter_layer_names, *module.other_param_names)
    elif isinstance(module, ModulesToSaveWrapper):
        names = ("modules_to_save",)
    else:
        return
    for name in names:
        container = getattr(module, name, None)
        if isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
            yield container


def _holds_adapter(module: nn.Module, adapter: str) -> bool:
    """Whether the PEFT layer ``module`` has weights of ``adapter``."""
    return any(adapter in container for container in _adapter_weight_dicts(module))


def adapter_parameters(model: nn.Module, adapter: str | None = None) -> list[nn.Parameter]:
    """The weights PEFT adds to ``model`` for ``adapter`` (every adapter when None), in
    ``model.parameters()`` order.

    Read from PEFT's layers (see :func:`_adapter_weight_dicts`), the containers ``PeftModel.set_requires_grad``
    switches, rather than matched on parameter names: tuner-layer weights (e.g. LoRA's A and B) and the
    adapter's ``modules_to_save`` copies, which train with it.
    """
    owned: set[int] = set()
    for module in model.modules():
        for container in _adapter_weight_dicts(module):
            for key, entry in container.items():
                if adapter is None or key == adapter:
                    # a Tensor where a functional_call stands in for a Parameter
                    entries = [entry] if isinstance(entry, torch.Tensor) else entry.parameters()
                    owned.update(id(parameter) for parameter in entries)
    return [parameter for parameter in model.parameters() if id(parameter) in owned]


def adapter_merge_problem(policy: nn.Module, adapter: str) -> str | None:
    """Why ``policy``'s ``adapter`` cannot be merged exactly into a plain model, or None when it can.

    :func:`merged_adapter_weights` merges LoRA adapters (any rank and alpha, ``use_rslora``,
    ``rank_pattern``, ``fan_in_fan_out``, ``use_dora``, ``lora_bias``, ``modules_to_save``, weight
    initialisations) on layers with a ``weight``, and ``target_parameters`` on such a ``weight``. Anything
    else would be dropped or merged wrongly, so it is named here, with the option behind it and its fix,
    for the trainer to refuse at ``__init__``.
    """
    from peft import PeftType

    config = policy.peft_config[adapter]
    if config.peft_type != PeftType.LORA:
        return (
            f"peft_config is {type(config).__name__} (peft_type {config.peft_type.value}) and only LoRA "
            "adapters can be merged into a full model; use a peft.LoraConfig"
        )
    if getattr(config, "layer_replication", None):
        return "peft_config.layer_replication adds layers a plain model does not have; drop layer_replication"
    base = policy.get_base_model()
    owners: dict[int, list[str]] = {}  # module names holding each parameter: a tied weight has two
    for module_name, module in base.named_modules(remove_duplicate=False):
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(module_name)
    for name, module in base.named_modules():
        problem = _modules_to_save_problem(name, module, adapter, owners) or _lora_layer_problem(
            name, module, adapter, owners
        )
        if problem is not None:
            return problem
    return None


def _modules_to_save_problem(
    name: str, module: nn.Module, adapter: str, owners: dict[int, list[str]]
) -> str | None:
    """A ``modules_to_save`` copy of a tied weight: the PEFT model uses it in one place, a merged model in
    both."""
    from peft.utils import ModulesToSaveWrapper

    if not isinstance(module, ModulesToSaveWrapper) or adapter not in module.modules_to_save:
        return None
    for parameter in module.original_module.parameters():
        others = [
            owner for owner in owners[id(parameter)] if owner != name and not owner.startswith(f"{name}.")
        ]
        if others:
            return (
                f"{name} (modules_to_save) has a weight tied to {others[0]}'s, which would take the trained copy "
                "in a merged model; remove it from peft_config.modules_to_save"
            )
    return None


def _lora_layer_problem(
    name: str, module: nn.Module, adapter: str, owners: dict[int, list[str]]
) -> str | None:
    """Why the PEFT layer ``module`` (``name``) cannot merge ``adapter`` into its base ``weight``."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not isinstance(module, BaseTunerLayer):
        return None
    if not _holds_adapter(module, adapter):
        return None
    kind = type(module).__name__
    # target_parameters (a ParamWrapper) merges like a layer on a plain `weight`, not on an MoE expert stack
    plain_weight = (
        getattr(module, "parameter_name", "weight") == "weight" and getattr(module, "num_experts", 1) == 1
    )
    if not (isinstance(module, LoraLayer) and hasattr(module.get_base_layer(), "weight") and plain_weight):
        option = {"ParamWrapper": "target_parameters", "TrainableTokensLayer": "trainable_token_indices"}
        return (
            f"{name} ({kind}) has adapter weights that cannot be merged into a plain weight; remove it from "
            f"peft_config.{option.get(kind, 'target_modules')}"
        )
    variant = module.lora_variant.get(adapter)
    if variant is not None and not isinstance(variant, DoraLinearVariant):  # DoRA of Linear and Embedding
        option = next(  # the layer's registry: {(config fields,): variant class}
            (
                "/".join(fields)
                for fields, variant_class in getattr(module, "lora_variants", {}).items()
                if variant_class is not None and type(variant) is variant_class
            ),
            type(variant).__name__,
        )
        return (
            f"the LoRA variant set by peft_config.{option} on {name} ({type(variant).__name__}) has no exact "
            "merge here; unset it (plain LoRA and use_dora are supported)"
        )
    base_layer = module.get_base_layer()
    if module.lora_bias.get(adapter) and getattr(base_layer, "bias", None) is None:
        return (
            f"peft_config.lora_bias=True on {name}, which has no bias for the merged model to hold; set "
            "lora_bias=False or target only layers with a bias"
        )
    others = [owner for owner in owners.get(id(base_layer.weight), []) if owner != f"{name}.base_layer"]
    if others:
        return (
            f"{name}'s weight is tied to {others[0]}'s, so a merged model would apply the adapter to both; "
            "remove it from peft_config.target_modules (or untie the weights)"
        )
    return None


def _merged_lora_weight(layer: nn.Module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
    """``layer``'s float32 base ``weight`` (a copy, updated in place) with ``adapter`` merged in.

    Plain LoRA adds PEFT's ``get_delta_weight`` (scaling, rsLoRA and ``fan_in_fan_out`` included). DoRA
    rescales each output row (column under ``fan_in_fan_out``) of ``W + dW`` by ``m / ||W + dW||``, as
    PEFT's ``DoraLinearVariant.merge_safe`` does, with PEFT's own norm; ``merge_safe`` itself is not called
    because it re-reads (and dequantizes) the layer's stored weight and caches the norm on the layer.
    """
    from peft.utils.other import transpose

    delta = layer.get_delta_weight(adapter).detach().to(weight.device, torch.float32)
    if layer.lora_variant.get(adapter) is None:
        return weight.add_(delta)
    dora = layer.lora_magnitude_vector[adapter]
    flip = dora.fan_in_fan_out  # True for embeddings: their rows are the input ids
    with torch.no_grad():
        norm = dora.get_weight_norm(weight, transpose(delta, flip), scaling=1)
    magnitude = dora.weight.detach().to(weight.device, torch.float32)
    return weight.add_(delta).mul_(transpose((magnitude / norm).view(-1, 1), flip))


def merged_adapter_weights(policy: nn.Module, adapter: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of ``policy``'s base model with ``adapter`` merged in, one float32 tensor at a time.

    Names are the plain model's checkpoint names (PEFT's ``.base_layer`` and ``.original_module`` levels
    removed). Each LoRA layer yields its (dequantized) base weight with ``adapter`` merged in (see
    :func:`_merged_lora_weight`) and, with ``lora_bias``, its base bias plus the adapter's scaled bias; a
    ``modules_to_save`` layer yields ``adapter``'s trained copy; weights of other adapters (a shared-base
    critic's) are never included. Tied weights come once. Nothing in ``policy`` is modified: the merge works
    on float32 copies rather than on the (possibly 4-bit) base, which would re-quantize them.

    Raises:
        ValueError: ``adapter`` cannot be merged exactly (see :func:`adapter_merge_problem`).
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    problem = adapter_merge_problem(policy, adapter)
    if problem is not None:
        raise ValueError(f"Cannot merge adapter {adapter!r} into a full model: {problem}.")
    base = policy.get_base_model()
    lora_weight_of: dict[int, nn.Module] = {}
    lora_bias_of: dict[int, nn.Module] = {}
    trained_copy: dict[int, tuple[torch.Tensor, nn.Module]] = {}
    for module in base.modules():
        # `_holds_adapter`, not `adapter in lora_A`: an Embedding keeps its factors in `lora_embedding_A/B`
        if isinstance(module, LoraLayer) and _holds_adapter(module, adapter):
            lora_weight_of[id(module.get_base_layer().weight)] = module
            if module.lora_bias.get(adapter):
                lora_bias_of[id(module.get_base_layer().bias)] = module
        if isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save:
            copy_module = module.modules_to_save[adapter]
            for (_, original), (_, trained) in zip(
                module.original_module.named_parameters(), copy_module.named_parameters(), strict=True
            ):
                trained_copy[id(original)] = (trained, copy_module)
    skip = {id(parameter) for parameter in adapter_parameters(base)}  # grows: a tied weight is taken once
    for module_name, module in base.named_modules():
        for name, parameter in module.named_parameters(prefix=module_name, recurse=False):
            if id(parameter) in skip:
                continue
            skip.add(id(parameter))
            source, owner = trained_copy.get(id(parameter), (parameter, module))
            weight = _full_precision(source, owner)
            if id(parameter) in lora_weight_of:
                weight = _merged_lora_weight(lora_weight_of[id(parameter)], adapter, weight)
            elif id(parameter) in lora_bias_of:
                layer = lora_bias_of[id(parameter)]
                lora_bias = layer.lora_B[adapter].bias.detach().to(weight.device, torch.float32)
                weight += lora_bias * layer.scaling[adapter]
            # PEFT keeps the layer it wraps as `<name>.base_layer` (LoRA) or `<name>.original_module`
            # (modules_to_save); the plain model has it at `<name>`.
            yield name.replace(".base_layer.", ".").replace(".original_module.", "."), weight


class _MergeCall(nn.Module):
    """``forward()`` merges ``policy``'s ``adapter``: what :func:`torch.func.functional_call` runs with the
    policy's parameters replaced (see :func:`merge_adapter_into_full_model`)."""

    def __init__(self, policy: nn.Module, adapter: str) -> None:
        super().__init__()
        self.policy = policy
        self.adapter = adapter

    def forward(self) -> dict[str, torch.Tensor]:
        return dict(merged_adapter_weights(self.policy, self.adapter))


def merge_adapter_into_full_model(
    policy: nn.Module, adapter: str, state_dict: dict[str, torch.Tensor] | None = None
) -> PreTrainedModel:
    """A new full-precision model: the (dequantized) base weights plus ``adapter``'s deltas.

    The trained policy is left untouched, so training can go on after a merged save. Deltas are added to
    dequantized float32 weights rather than merged into 4-bit ones, which would re-quantize them and lose
    most of the update. The result has no quantization config and loads with plain ``from_pretrained``.

    ``state_dict`` (the policy's own keys, e.g. the full weights gathered from ZeRO-3 or FSDP2 shards, whose
    local parameters are empty partitions or ``DTensor`` shards) stands in for the policy's parameters during
    the merge, through :func:`torch.func.functional_call`; the policy's module structure (its LoRA layers)
    tells what to merge. No collective runs, so the main process alone can call it.
    """
    from transformers import AutoModelForCausalLM

    base = policy.get_base_model()
    if state_dict is None:
        state = dict(merged_adapter_weights(policy, adapter))
    else:
        call = _MergeCall(policy, adapter)
        # One name per tied weight (named_parameters' default); functional_call ties the others to it.
        names = {name for name, _ in call.named_parameters()}
        weights = {f"policy.{key}": value for key, value in state_dict.items() if f"policy.{key}" in names}
        missing = sorted(names - set(weights))
        if missing:
            raise RuntimeError(f"The gathered state dict has no weights for {missing[:5]}; cannot merge.")
        state = torch.func.functional_call(call, weights, (), tie_weights=True, strict=False)
    config = copy.deepcopy(base.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    merged = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = merged.load_state_dict(state, strict=False)
    tied = set(getattr(merged, "_tied_weights_keys", None) or [])
    if unexpected or [key for key in missing if key not in tied and "lm_head" not in key]:
        raise RuntimeError(
            f"Merging the adapter left weights unmatched: missing {missing}, unexpected {unexpected}."
        )
    merged.tie_weights()
    merged.generation_config = copy.deepcopy(base.generation_config)
    return merged.eval()  # as from_pretrained returns it: from_config leaves dropout on
