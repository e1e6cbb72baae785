"""Rollout generation that captures per-token log-probabilities and entropies and the update's
log-probabilities computed chunk by chunk (``capture``, over ``token_logprobs``, ``output_head`` and
``sharding``), the vLLM backend (``vllm_backend``), and the model inputs (prompt encoding, padding, stop
tokens) every part of the package builds the same way (``inputs``)."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RolloutOutput": "capture",
    "default_logprob_chunk_size": "token_logprobs",
    "forward_logprobs": "capture",
    "fsdp2_root_unsharded": "sharding",
    "generate_with_logprobs": "capture",
    "logprobs_from_hidden_states": "capture",
    "logprobs_from_logits": "token_logprobs",
    "output_head_split": "output_head",
    "pure_sampling_config": "capture",
    "sequence_logprobs": "capture",
    "encode_prompt": "inputs",
    "eos_token_id_list": "inputs",
    "is_conversational": "inputs",
    "left_pad": "inputs",
    "model_device": "inputs",
    "model_stop_token_ids": "inputs",
    "right_pad": "inputs",
    "sequence_inputs": "inputs",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
