"""Building the critic: a separate model (:func:`load_critic`, :func:`build_critic_from_policy`), or the module
the update runs through with the critic inside it (:func:`wrap_policy_and_critic`: the shared-base critic, the
head critic or the policy beside a separate critic)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel
from transformers.integrations import is_deepspeed_zero3_enabled

from trl_sae.gguf import from_pretrained_dense, resolve_pretrained
from trl_sae.trainer.config import SAEPPOConfig
from trl_sae.trainer.critics.head import HeadCritic
from trl_sae.trainer.critics.policy_and_critic import PolicyAndCritic, SharedBaseCritic
from trl_sae.trainer.setup.adapters import base_model

__all__ = [
    "build_critic_from_policy",
    "check_model_arguments",
    "critic_lora_config",
    "load_critic",
    "uses_head_critic",
    "uses_shared_critic",
    "wrap_policy_and_critic",
]


def uses_shared_critic(
    args: SAEPPOConfig, value_model: str | PreTrainedModel | None, peft_config: Any
) -> bool:
    """Whether the critic is a second adapter (+ value head) on the policy's base: the default with a
    ``peft_config``, or ``value_model="shared"``."""
    return args.uses_critic and peft_config is not None and value_model in (None, "shared")


def uses_head_critic(args: SAEPPOConfig, value_model: str | PreTrainedModel | None) -> bool:
    """Whether the critic is a value head on the policy's own forward (``value_model="head"``, see
    :class:`~trl_sae.trainer.critics.head.HeadCritic`)."""
    return args.uses_critic and value_model == "head"


def build_critic_from_policy(policy: nn.Module) -> PreTrainedModel:
    """A one-label sequence classifier with the policy's architecture, initialised from its backbone.

    The score head starts at zero so the first values are 0 rather than noise; the backbone starts from
    the policy's weights (the usual PPO initialisation when no reward model is available).
    """
    base = base_model(policy)
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
    if is_deepspeed_zero3_enabled():
        _copy_backbone_and_zero_head_zero3(source, target, critic.score)
    else:
        target.load_state_dict(source.state_dict())
        with torch.no_grad():
            for parameter in critic.score.parameters():
                parameter.zero_()
    return critic.to(next(base.parameters()).device)


def _copy_backbone_and_zero_head_zero3(source: nn.Module, target: nn.Module, score: nn.Module) -> None:
    """:func:`build_critic_from_policy`'s copy under DeepSpeed ZeRO-3.

    With ``zero3_init_flag`` transformers builds the critic inside ``deepspeed.zero.Init``, so each of its
    parameters holds only this rank's shard (size 0 outside a gather); a policy loaded from a path is
    partitioned the same way, and a policy built before the trainer is not. So every tensor is copied
    inside ``deepspeed.zero.GatheredParameters`` over the source and target tensors (the pattern of
    transformers' ``resize_token_embeddings``), one state-dict entry at a time so that no more than one
    weight of each model is gathered at once. ``modifier_rank=0`` broadcasts rank 0's copy and
    re-partitions on exit; every rank copies (all hold the same policy), which also fills the buffers
    ZeRO-3 does not partition. The score head is zeroed inside a gather the same way.
    """
    import deepspeed

    source_state = source.state_dict(keep_vars=True)
    target_state = target.state_dict(keep_vars=True)
    missing = sorted(target_state.keys() - source_state.keys())
    unexpected = sorted(source_state.keys() - target_state.keys())
    # full shapes: a partitioned parameter keeps its own in ``ds_shape``; checked before any collective
    mismatched = [
        f"{key}: {tuple(_full_shape(source_state[key]))} into {tuple(_full_shape(tensor))}"
        for key, tensor in target_state.items()
        if key in source_state and _full_shape(source_state[key]) != _full_shape(tensor)
    ]
    if missing or unexpected or mismatched:
        raise RuntimeError(
            f"Cannot copy the policy's {type(source).__name__} into the critic's {type(target).__name__}: "
            f"missing {missing}, unexpected {unexpected}, size mismatch {mismatched}."
        )
    with torch.no_grad():
        for key, tensor in target_state.items():
            value = source_state[key]
            with deepspeed.zero.GatheredParameters([value, tensor], modifier_rank=0):
                tensor.data.copy_(value.data)
        parameters = list(score.parameters())
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
            for parameter in parameters:
                parameter.data.zero_()


def _full_shape(tensor: torch.Tensor) -> torch.Size:
    """A tensor's shape; a ZeRO-3 partitioned parameter's full shape (its ``ds_shape``)."""
    return getattr(tensor, "ds_shape", tensor.shape)


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
        source, init_kwargs = resolve_pretrained(value_model, "value_model", model_init_kwargs)
        return from_pretrained_dense(AutoModelForSequenceClassification, source, num_labels=1, **init_kwargs)
    if not isinstance(value_model, nn.Module) or not hasattr(value_model, "score"):
        raise ValueError(
            "`value_model` must be None, a path, or a sequence-classification model with a `score` head and "
            f"one label; got {type(value_model).__name__}."
        )
    return value_model


def critic_lora_config(peft_config: Any) -> Any:
    """The critic adapter copies the policy's LoRA settings; its head is the trainer's value head."""
    critic_config = copy.deepcopy(peft_config)
    critic_config.task_type = None
    critic_config.modules_to_save = None
    return critic_config


def wrap_policy_and_critic(
    policy: nn.Module,
    critic: nn.Module | None,
    shared_critic_config: Any = None,
    policy_adapter: str = "default",
    logprob_chunk_size: int | None = None,
    head_critic_grad_scale: float | None = None,
    head_critic_layer: int | None = None,
) -> PolicyAndCritic:
    """The one module the update runs through: the policy beside its critic, or (with
    ``shared_critic_config``, the policy's ``peft_config``) a :class:`SharedBaseCritic` that adds the
    critic adapter to the policy's base, or (with ``head_critic_grad_scale``, its trunk gradient scale) a
    :class:`~trl_sae.trainer.critics.head.HeadCritic` reading decoder layer ``head_critic_layer`` (None: the
    final hidden states). ``logprob_chunk_size``: positions per output-head call of its log-probs (None:
    chosen from the vocabulary)."""
    if head_critic_grad_scale is not None:
        module: PolicyAndCritic = HeadCritic(policy, head_critic_grad_scale, head_critic_layer)
    elif shared_critic_config is not None:
        module = SharedBaseCritic(
            policy, critic_lora_config(shared_critic_config), policy_adapter=policy_adapter
        )
    else:
        module = PolicyAndCritic(policy, critic)
    module.logprob_chunk_size = logprob_chunk_size
    return module


def check_model_arguments(
    args: SAEPPOConfig, value_model: str | PreTrainedModel | None, peft_config: Any
) -> None:
    """Refuse critic arguments that cannot apply, before any model is built."""
    if value_model is not None and not args.uses_critic:
        raise ValueError(
            f"`value_model` was given but advantage_estimator={args.advantage_estimator!r} trains no "
            "critic; drop it."
        )
    if value_model == "shared" and peft_config is None:
        raise ValueError(
            "value_model='shared' puts the critic on the policy's base as a second LoRA adapter, so it needs "
            "a `peft_config`; pass one (e.g. peft.LoraConfig(r=16, target_modules='all-linear')) or let "
            "value_model=None build a separate critic."
        )
    if args.value_head_trunk_grad_scale != 0 and value_model != "head":
        raise ValueError(
            f"SAEPPOConfig.value_head_trunk_grad_scale={args.value_head_trunk_grad_scale} sets how much value "
            f"gradient the head critic passes to the policy's trunk, but value_model={_critic_name(value_model)} "
            "is another critic; pass value_model='head' or leave the scale at 0."
        )
    if args.value_head_layer is not None and not uses_head_critic(args, value_model):
        raise ValueError(
            f"SAEPPOConfig.value_head_layer={args.value_head_layer} picks the decoder layer the head critic reads, "
            f"but value_model={_critic_name(value_model)} is another critic; pass value_model='head' or leave "
            "value_head_layer=None."
        )


def _critic_name(value_model: str | PreTrainedModel | None) -> str:
    return repr(value_model) if value_model is None or isinstance(value_model, str) else "<a model>"


# LoRA initialisations that rewrite the base weights when the adapter is created (the base keeps a residual).
