"""What the trainer samples with: the stop tokens of a run and the newline tokens a segmenter reads.

The sampling ``GenerationConfig`` itself is :func:`trl_sae.generation.capture.pure_sampling_config`: a config
of its own, so the model's ``generation_config`` (and the file ``save_model`` writes) stays as loaded, with
every field that changes the distribution set, so sampling is exactly ``softmax(logits / T)``, the
distribution the update's teacher-forced log-probs come from, and the first PPO ratio is 1.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trl_sae.generation.inputs import model_stop_token_ids
from trl_sae.trainer.config import SAEPPOConfig

__all__ = ["newline_token_ids", "stop_token_ids"]


def stop_token_ids(
    args: SAEPPOConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> list[int]:
    """The token ids that end a completion: with ``stop_token="eos"`` every EOS the checkpoint declares
    (Qwen3 instruct: ``<|im_end|>`` and ``<|endoftext|>``) plus the tokenizer's; ``stop_token_id`` alone; or
    none (an empty list: never stop)."""
    if args.stop_token and args.stop_token_id is not None:
        raise ValueError("Set only one of `stop_token` and `stop_token_id`.")
    if args.stop_token not in (None, "eos"):
        raise ValueError(f"`stop_token` must be 'eos' or None, got {args.stop_token!r}.")
    if args.stop_token == "eos":
        return model_stop_token_ids(model, tokenizer)
    return [] if args.stop_token_id is None else [int(args.stop_token_id)]


def newline_token_ids(tokenizer: PreTrainedTokenizerBase, segmentation: str) -> list[int]:
    """The ids of every token whose text contains a newline (what newline segmentation reads); refused for a
    tokenizer with none."""
    ids = [
        index
        for token, index in tokenizer.get_vocab().items()
        if "\n" in tokenizer.convert_tokens_to_string([token])
    ]
    if not ids:
        raise ValueError(
            f"segmentation={segmentation!r} reads newline tokens but the tokenizer has no token containing a "
            "newline."
        )
    return ids
