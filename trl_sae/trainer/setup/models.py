"""Model construction for :class:`~trl_sae.SAEPPOTrainer`, in one place.

Everything the trainer builds before its first step, in the order ``SAEPPOTrainer._setup_models`` calls it:

* the policy: :func:`load_policy` (``from_pretrained`` with ``model_init_kwargs``, 4-bit via
  :func:`four_bit_config`), :func:`prepare_quantized_policy` (QLoRA), :func:`wrap_with_peft` and
  :func:`select_adapters`; and its tokenizer, :func:`load_tokenizer`;
* the critic: :func:`load_critic` (a separate model, or :func:`build_critic_from_policy`), or the
  shared-base critic (:func:`uses_shared_critic`, :func:`critic_lora_config`) or the head critic
  (:func:`uses_head_critic`) that :func:`wrap_policy_and_critic` builds together with the policy;
* the reference policy, :func:`build_reference`;
* :func:`disable_dropout` on each of them.

The modules they return (``PolicyAndCritic``, ``SharedBaseCritic``) live in :mod:`trl_sae.trainer.critics.policy_and_critic`,
``HeadCritic`` in :mod:`trl_sae.trainer.critics.head`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from trl.trainer.utils import disable_dropout_in_model

from trl_sae.gguf import from_pretrained_dense, resolve_pretrained, tokenizer_from_pretrained
from trl_sae.trainer.config import SAEPPOConfig
from trl_sae.trainer.setup.adapters import adapter_merge_problem

__all__ = [
    "build_reference",
    "check_adapter_merge",
    "check_peft_config",
    "disable_dropout",
    "enable_gradient_checkpointing",
    "four_bit_config",
    "load_policy",
    "load_tokenizer",
    "prepare_quantized_policy",
    "select_adapters",
    "wrap_with_peft",
]


# ----------------------------------------------------------------------------------------------------
# Policy and tokenizer
# ----------------------------------------------------------------------------------------------------
def load_policy(model: str | PreTrainedModel, args: SAEPPOConfig) -> PreTrainedModel:
    """The policy: ``model`` loaded with ``args.model_init_kwargs`` (4-bit with ``load_in_4bit``) when it
    is a Hub id or path (a ``*.gguf`` file loads dequantized, :mod:`trl_sae.gguf`), else checked and
    returned as given."""
    if isinstance(model, str):
        source, init_kwargs = resolve_pretrained(model, "model", args.model_init_kwargs)
        if args.load_in_4bit:
            init_kwargs.setdefault("quantization_config", four_bit_config(args))
        return from_pretrained_dense(AutoModelForCausalLM, source, **init_kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a PreTrainedModel or a Hub id / path, got {type(model).__name__}.")
    if args.model_init_kwargs:
        raise ValueError(
            "`model_init_kwargs` only applies when `model` is a Hub id or path; the model you passed is "
            "already loaded. Drop `model_init_kwargs` or pass the model's name."
        )
    if args.load_in_4bit and not getattr(model, "is_loaded_in_4bit", False):
        raise ValueError(
            "`load_in_4bit=True` quantizes while loading, so `model` must be a Hub id or path; or load it "
            "yourself with a BitsAndBytesConfig(load_in_4bit=True) and set load_in_4bit=False."
        )
    return model


def four_bit_config(args: SAEPPOConfig) -> Any:
    """NF4 with double quantisation; compute in bf16 where the device supports it (QLoRA's recipe)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "load_in_4bit=True needs bitsandbytes: pip install 'trl-sae[quantization]'."
        ) from error
    from transformers import BitsAndBytesConfig

    compute_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load_tokenizer(
    processing_class: PreTrainedTokenizerBase | None, model: str | PreTrainedModel, args: SAEPPOConfig
) -> PreTrainedTokenizerBase:
    """``processing_class``, or the tokenizer of the ``model`` path (left padding); pad defaults to EOS."""
    if processing_class is None:
        if not isinstance(model, str):
            raise ValueError("`processing_class` (the tokenizer) is required when `model` is a loaded model.")
        source, init_kwargs = resolve_pretrained(model, "model", args.model_init_kwargs)
        processing_class = tokenizer_from_pretrained(source, init_kwargs, padding_side="left")
    if processing_class.pad_token_id is None:
        processing_class.pad_token = processing_class.eos_token
    return processing_class


_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


def check_peft_config(peft_config: Any, args: SAEPPOConfig, ref_model: PreTrainedModel | None) -> None:
    """Refuse LoRA options that would train or move the base model, before any model is built.

    The trainer optimises adapter weights only (the base is frozen: it is the KL reference with adapters
    disabled, and the shared critic's base), so an option that trains base weights would be ignored, and one
    that rewrites them at initialisation would make that reference something other than the starting policy.
    """
    if peft_config is None or getattr(peft_config, "peft_type", None) is None:
        return
    bias = getattr(peft_config, "bias", "none")
    if bias != "none":
        raise ValueError(
            f"peft_config.bias={bias!r} makes the base model's biases trainable, but trl-sae trains adapter "
            "weights only (the base is the KL reference and the shared critic's base); set bias='none', or "
            "lora_bias=True for biases the adapter owns."
        )
    init = getattr(peft_config, "init_lora_weights", True)
    rewrites_base = isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS)
    reference_is_base = ref_model is None and args.ref_adapter_name is None
    if rewrites_base and reference_is_base and args.kl_coef > 0:
        raise ValueError(
            f"peft_config.init_lora_weights={init!r} rewrites the base weights when the adapter is created, so "
            f"the KL reference (the base with adapters disabled) would not be the starting policy; with "
            f"kl_coef={args.kl_coef} set kl_coef=0, pass a ref_model, or use init_lora_weights=True."
        )


def prepare_quantized_policy(
    policy: PreTrainedModel, peft_config: Any, args: SAEPPOConfig
) -> PreTrainedModel:
    """A 4/8-bit base made ready for adapter training (QLoRA); any other policy as given."""
    if getattr(policy, "is_loaded_in_4bit", False) or getattr(policy, "is_loaded_in_8bit", False):
        if peft_config is None:
            raise ValueError(
                "A quantized base cannot be trained directly: pass a `peft_config` (QLoRA) to train adapters."
            )
        from peft import prepare_model_for_kbit_training

        policy = prepare_model_for_kbit_training(
            policy,
            use_gradient_checkpointing=bool(args.gradient_checkpointing),
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False},
        )
    return policy


def wrap_with_peft(policy: PreTrainedModel, peft_config: Any, adapter_name: str = "default") -> nn.Module:
    """``policy`` with a new ``adapter_name`` adapter from ``peft_config`` (None: the policy unchanged)."""
    if peft_config is None:
        return policy
    from peft import PeftConfig, PeftModel, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"`peft_config` must be a peft.PeftConfig (e.g. LoraConfig), got {type(peft_config).__name__}."
        )
    if isinstance(policy, PeftModel):
        raise ValueError(
            "You passed a PeftModel together with `peft_config`. Either pass the PeftModel alone, or merge "
            "it (model.merge_and_unload()) and pass the base model with `peft_config`."
        )
    return get_peft_model(policy, peft_config, adapter_name=adapter_name)


def select_adapters(policy: nn.Module, args: SAEPPOConfig, is_peft_model: bool) -> None:
    """Check ``model_adapter_name`` / ``ref_adapter_name`` against the policy's adapters and activate the
    trained one.

    ``ref_adapter_name`` names an adapter of a ``PeftModel`` policy that serves as the KL reference
    instead of the base with every adapter disabled (as in TRL's PPOTrainer).
    """
    named = {
        name: value
        for name, value in (
            ("model_adapter_name", args.model_adapter_name),
            ("ref_adapter_name", args.ref_adapter_name),
        )
        if value is not None
    }
    if not named:
        return
    if not is_peft_model:
        raise ValueError(
            f"SAEPPOConfig.{next(iter(named))} names a PEFT adapter, but the policy has none; pass a "
            "peft.PeftModel holding the adapters, or a peft_config."
        )
    for name, value in named.items():
        if value not in policy.peft_config:
            raise ValueError(
                f"SAEPPOConfig.{name}={value!r} is not an adapter of the policy (it has "
                f"{sorted(policy.peft_config)})."
            )
    if args.model_adapter_name is not None:
        policy.set_adapter(args.model_adapter_name)  # the trained adapter is the active one
    # peft's set_adapter leaves only the active adapter trainable, so the reference adapter stays frozen.


def check_adapter_merge(policy: nn.Module, args: SAEPPOConfig, is_peft_model: bool) -> None:
    """Refuse a policy adapter that ``merge_adapters`` (merged saves) or ``use_vllm`` (weight pushes) would
    have to merge into a full model but cannot merge exactly (see
    :func:`~trl_sae.trainer.setup.adapters.adapter_merge_problem`), before any training."""
    merging = [name for name in ("merge_adapters", "use_vllm") if getattr(args, name, False)]
    if not is_peft_model or not merging:
        return
    problem = adapter_merge_problem(policy, policy.active_adapter)
    if problem is not None:
        raise ValueError(
            f"SAEPPOConfig.{merging[0]}=True merges the policy's LoRA adapter into a full model, but {problem} "
            f"(or set {merging[0]}=False)."
        )


def enable_gradient_checkpointing(
    model: nn.Module, policy: nn.Module, args: SAEPPOConfig, is_peft_model: bool
) -> None:
    """Activation checkpointing on the policy-and-critic module, with ``args``' kwargs (non-reentrant by
    default); a PEFT policy's frozen embeddings then pass gradients on to the adapters."""
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False}
    )
    if is_peft_model:
        policy.enable_input_require_grads()


# ----------------------------------------------------------------------------------------------------
# Reference policy
# ----------------------------------------------------------------------------------------------------
def build_reference(
    ref_model: PreTrainedModel | None, policy: nn.Module, args: SAEPPOConfig, is_peft_model: bool
) -> nn.Module | None:
    """The frozen KL reference: ``ref_model``, a copy of the policy, or None when none is needed (no KL
    penalty, or a PEFT policy whose base with the adapter disabled is the reference)."""
    if args.kl_coef == 0:
        return None  # no KL penalty: no reference model and no reference forward pass
    if ref_model is not None:
        if ref_model is policy:
            raise ValueError("`ref_model` must not be the policy itself; pass a copy, or None.")
        return ref_model.eval()
    if is_peft_model:
        return None  # the base with the adapter disabled is the reference (null_ref_context)
    from trl.experimental.utils import create_reference_model

    return create_reference_model(policy)


# ----------------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------------
def _is_dropout_name(name: str) -> bool:
    """Dropout probabilities as transformers names them: ``dropout``, ``attention_dropout``,
    ``hidden_dropout_prob``, ``attention_probs_dropout_prob``, ``resid_pdrop``, ``embd_pdrop``, ``layerdrop``,
    ``drop_path_rate``, ..."""
    name = name.lower()
    return "dropout" in name or name.endswith(("pdrop", "layerdrop")) or name.startswith("drop_path")


def disable_dropout(model: nn.Module) -> None:
    """Switch off every kind of dropout in ``model`` (and any model nested in it), so the update's forward
    pass computes the same distribution as the rollout's ``eval()`` pass and the first PPO ratio is 1.

    TRL's ``disable_dropout_in_model`` zeroes ``nn.Dropout`` modules only; many architectures instead call
    ``F.dropout(p=self.dropout)`` with a float they copied from the config at construction (OPT's
    ``dropout``/``attention_dropout``/``activation_dropout``, ``layerdrop``, ...). So this also zeroes every
    positive float attribute with a dropout name on every module, and on every model config (and its
    sub-configs) for code that reads the config at forward time. The saved ``config.json`` therefore
    records the dropout the model was actually trained with: none.
    """
    disable_dropout_in_model(model)
    pending = []
    for module in model.modules():
        _zero_dropout_attributes(module)
        if isinstance(vars(module).get("config"), PreTrainedConfig):
            pending.append(module.config)
    seen: set[int] = set()
    while pending:  # the configs and their sub-configs (text_config, ...)
        config = pending.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        _zero_dropout_attributes(config)
        pending.extend(value for value in vars(config).values() if isinstance(value, PreTrainedConfig))


def _zero_dropout_attributes(obj: Any) -> None:
    for name, value in list(vars(obj).items()):
        if isinstance(value, float) and value > 0 and _is_dropout_name(name):
            setattr(obj, name, 0.0)
