"""Model inputs shared by the trainer, the evaluation, the analysis and the demo: prompt encoding, padding,
the concatenated ``[prompt | completion]`` sequence, a model's stop tokens, its device and its peft base.

One implementation on purpose: a prompt rendered, padded or stopped differently in the analysis than in
the trainer would measure another policy than the one PPO trains. Index conventions: docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "encode_prompt",
    "eos_token_id_list",
    "eval_mode",
    "is_conversational",
    "left_pad",
    "model_device",
    "model_stop_token_ids",
    "peft_base_model",
    "prompt_openings",
    "right_pad",
    "sequence_inputs",
    "truncate_prompt",
]


def is_conversational(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of chat messages (``[{"role": ..., "content": ...}, ...]``)."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and isinstance(prompt[0], Mapping)
        and "role" in prompt[0]
    )


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of a prompt as the policy sees it at generation time.

    Chat prompts (a list of messages) go through the chat template with the generation prompt appended and
    are tokenized without special tokens, as transformers' ``apply_chat_template`` does: the template writes
    any BOS the model expects. A plain string is the exact text the policy continues, preceded by the BOS
    when the tokenizer puts one before plain text (``tokenizer(text)`` starts with ``bos_token_id``, as
    Gemma's and Llama's do) and the text does not already begin with it. TRL's trainers add no special
    tokens here; a model trained always to see its BOS first reads text without it as garbage (a Gemma-family
    model: 7.95 nats/token on an English sentence without it, 2.80 with it). A tokenizer that adds no BOS
    (Qwen's) gives the text's ids unchanged.

    Raises:
        ValueError: ``prompt`` is neither a string nor a list of chat messages.
    """
    if is_conversational(prompt):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise ValueError(
            f"A prompt must be a string or a list of chat messages ({{'role', 'content'}}); got {type(prompt)}."
        )
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    # An empty text stays empty, so the dataset check still refuses it as an empty prompt.
    if bos is not None and ids and ids[:1] != [bos] and tokenizer(prompt)["input_ids"][:1] == [bos]:
        return [bos, *ids]
    return ids


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def prompt_openings(tokenizer: Any) -> list[list[int]]:
    """The tokens :func:`encode_prompt` writes before a prompt's content: for text, the BOS it adds (or
    nothing); with a chat template, also the template's opening up to the first user message's content
    (the BOS, a default system message, ``<|im_start|>user\n``).

    Each opening is the common prefix of two prompts that differ only in their content, so no template is
    parsed; a token the content could merge into is left out, never a content token put in.
    """

    def opening(render: Any) -> list[int]:
        first, second = encode_prompt(tokenizer, render("0")), encode_prompt(tokenizer, render("1"))
        return first[: _common_prefix_length(first, second)]

    openings = [opening(lambda content: content)]
    if getattr(tokenizer, "chat_template", None) is not None:
        openings.append(opening(lambda content: [{"role": "user", "content": content}]))
    return openings


def truncate_prompt(ids: Sequence[int], max_length: int, openings: Sequence[Sequence[int]]) -> list[int]:
    """``ids`` cut to ``max_length`` tokens by dropping their middle: the opening they start with (the longest
    prefix shared with one of ``openings``, see :func:`prompt_openings`) stays, then their last tokens (the
    chat template's generation prompt and the end of the question).

    Left truncation alone would drop the BOS and the template's start, which a model trained always to see
    them reads as garbage (see :func:`encode_prompt`); a prompt no longer than ``max_length`` is unchanged.

    Raises:
        ValueError: the opening alone takes ``max_length`` tokens or more.
    """
    ids = list(ids)
    if len(ids) <= max_length:
        return ids
    head = max((_common_prefix_length(ids, opening) for opening in openings), default=0)
    if head >= max_length:
        raise ValueError(
            f"max_prompt_length={max_length} leaves no room after the prompt's opening ({head} tokens: the BOS "
            "and the chat template's start, which truncation keeps); raise max_prompt_length."
        )
    return ids[:head] + ids[len(ids) - (max_length - head) :]


def left_pad(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, P)`` left-padded ids and ``(B, P)`` attention mask (1 on tokens, 0 on padding), both long.

    Left padding for generation: ``generate`` appends on the right, so every row's last prompt token sits
    in the final column and new tokens are added in lockstep.
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if len(seq):
            ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def right_pad(
    seqs: Sequence[Sequence[int | float] | torch.Tensor], value: float | int, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """``(B, T)`` rows of ``seqs`` padded on the right with ``value``; ``T`` is the longest row (at least 1)."""
    width = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.as_tensor(seq, dtype=dtype)
    return out


def sequence_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Model inputs of ``[left-padded prompt | right-padded completion]``.

    Args:
        prompt_ids: ``(B, P)`` long, left-padded.
        prompt_mask: ``(B, P)``, 0 on the padding.
        completion_ids: ``(B, T)`` long, right-padded.
        completion_mask: ``(B, T)``, 1 on valid tokens.

    Returns:
        ``input_ids``, ``attention_mask`` (long) and ``position_ids``, each ``(B, P + T)``; positions count
        valid tokens only (``cumsum(mask) - 1``), as during generation, so the left padding does not shift them.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def peft_base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (``PeftModel.get_base_model()``, adapters still
    injected), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_device(model: torch.nn.Module) -> torch.device:
    """The device inputs of ``model`` go to: its ``device`` attribute, else its first parameter's."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def eos_token_id_list(eos_token_id: int | list[int] | torch.Tensor | None) -> list[int]:
    """A ``generation_config.eos_token_id`` (one id, a list, a tensor or None) as a list of ints."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        return [int(x) for x in eos_token_id.flatten().tolist()]
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(x) for x in eos_token_id]


def model_stop_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every token id that ends a completion of ``model``: the ids its ``generation_config.eos_token_id``
    lists (one id or several, e.g. Qwen3 instruct's ``[<|im_end|>, <|endoftext|>]``), then the tokenizer's
    EOS if it is not among them. Generation must stop at any of them, and the mask must end there too.
    """
    generation_config = getattr(model, "generation_config", None)
    ids = eos_token_id_list(getattr(generation_config, "eos_token_id", None))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` in ``eval()`` mode inside the block, then every submodule back in the mode it had.

    Not ``model.train(was_training)``: that puts every submodule in the top module's mode, and a model can
    hold both (``from_pretrained`` loads the base in eval mode, peft adds its adapters in train mode), so a
    generation would leave the model in another state than it found it (a run with an evaluation before it
    would then train another model than one without).
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training
