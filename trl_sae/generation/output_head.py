"""A causal LM's decoder and output head, found under its wrappers, so the log-prob passes can run the decoder
alone and apply the head a chunk of positions at a time (:func:`output_head_split`).
"""

from __future__ import annotations

import inspect

import torch

from trl_sae.generation.inputs import peft_base_model

__all__ = ["head_vocab_size", "output_head_split", "supports_logits_to_keep", "unwrap_model"]

# Config attributes of architectures whose forward changes the head's output after the matmul (Gemma 2/3's
# final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling): applying the head module alone
# would give other logits, so such models keep the logits path.
_POST_HEAD_LOGIT_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DistributedDataParallel-style (``.module``) and peft wrappers."""
    base = model
    while isinstance(getattr(base, "module", None), torch.nn.Module):  # DistributedDataParallel & co.
        base = base.module
    return peft_base_model(base)


def supports_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the underlying causal LM takes ``logits_to_keep`` (PEFT and DDP wrappers pass kwargs on)."""
    try:
        return "logits_to_keep" in inspect.signature(unwrap_model(model).forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return False


def output_head_split(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | str:
    """``(decoder, head)`` of a causal LM, or a sentence saying why its head cannot be applied separately.

    The decoder (``get_decoder()``: the transformer body, final norm included) and the output head
    (``get_output_embeddings()``) are the modules *inside* any peft wrapper, so a LoRA-adapted head (peft
    replaces ``lm_head`` by a LoRA layer whose call adds the adapter), a ``modules_to_save`` copy, a tied
    head (its weight is the embedding's) and the active or disabled adapters all act exactly as in the
    model's own forward. ``decoder(...).last_hidden_state`` followed by ``head`` is what transformers'
    ``*ForCausalLM.forward`` computes, except for architectures that transform the logits afterwards
    (soft-capping, scaling), which are refused here.
    """
    base = unwrap_model(model)
    get_decoder = getattr(base, "get_decoder", None)
    get_head = getattr(base, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return f"{type(base).__name__} has no get_decoder()/get_output_embeddings()"
    head = get_head()
    decoder = get_decoder()
    if not isinstance(head, torch.nn.Module):
        return f"{type(base).__name__}.get_output_embeddings() returned no module"
    if not isinstance(decoder, torch.nn.Module) or decoder is base:
        return f"{type(base).__name__}.get_decoder() returned no separate decoder"
    config = getattr(base, "config", None)
    for name in _POST_HEAD_LOGIT_ATTRIBUTES:
        value = getattr(config, name, None)
        if value is not None and value != 1.0 and not (name == "final_logit_softcapping" and value == 0):
            return f"{type(base).__name__} transforms its logits after the head ({name}={value})"
    return decoder, head


def head_vocab_size(head: torch.nn.Module) -> int:
    """Output size of the head module (a Linear, a peft LoRA layer around one, a 4-bit Linear)."""
    out_features = getattr(head, "out_features", None)
    if isinstance(out_features, int):
        return out_features
    return int(head.weight.shape[0])
