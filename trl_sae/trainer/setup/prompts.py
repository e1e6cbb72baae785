"""The trainer's prompt datasets: tokenised once (chat templates applied), prompts longer than
``max_prompt_length`` refused or cut (``overlong_prompts``), and evaluation settings that need an
``eval_dataset`` refused without one."""

from __future__ import annotations

import math
import warnings
from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from trl_sae.generation.inputs import encode_prompt, prompt_openings, truncate_prompt
from trl_sae.trainer.config import SAEPPOConfig

__all__ = [
    "check_evaluation_setup",
    "derive_batch_sizes",
    "handle_overlong_prompts",
    "tokenize_prompt_dataset",
]


def check_evaluation_setup(args: SAEPPOConfig, eval_dataset: Dataset | None) -> None:
    """Refuse evaluation during training without an ``eval_dataset``."""
    if (args.eval_strategy != "no" or args.eval_on_start) and eval_dataset is None:
        setting = (
            f"eval_strategy={args.eval_strategy.value!r}" if args.eval_strategy != "no" else "eval_on_start"
        )
        raise ValueError(
            f"SAEPPOConfig.{setting} evaluates during training, but no `eval_dataset` was given; pass "
            "eval_dataset=... to the trainer or set eval_strategy='no'."
        )


def tokenize_prompt_dataset(
    dataset: Dataset | None, name: str, tokenizer: PreTrainedTokenizerBase, num_proc: int | None = None
) -> Dataset:
    """Tokenise prompts into ``input_ids`` (chat template for message lists), keeping other columns; a
    dataset of ``input_ids`` gets the decoded ``prompt`` column instead."""
    if dataset is None:
        raise ValueError(f"`{name}` is required: a datasets.Dataset with a `prompt` column.")
    if len(dataset) == 0:
        raise ValueError(f"`{name}` is empty; it needs at least one prompt.")
    columns = dataset.column_names

    if "prompt" in columns:
        first = dataset[0]["prompt"]
        is_chat = isinstance(first, list)
        if is_chat and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"`{name}` holds chat messages but the tokenizer has no chat template; set "
                "`tokenizer.chat_template` or pass plain-text prompts."
            )

        def tokenize(row: dict[str, Any]) -> dict[str, Any]:
            return {"input_ids": encode_prompt(tokenizer, row["prompt"])}

        dataset = dataset.map(tokenize, num_proc=num_proc, desc=f"Tokenizing {name}")
    elif "input_ids" in columns:
        prompts = [tokenizer.decode(list(ids), skip_special_tokens=False) for ids in dataset["input_ids"]]
        dataset = dataset.add_column("prompt", prompts)
    else:
        raise ValueError(
            f"`{name}` needs a `prompt` column (text or chat messages) or tokenised `input_ids`; it has "
            f"{columns}. Rename your prompt column with dataset.rename_column(old, 'prompt')."
        )
    if any(len(ids) == 0 for ids in dataset["input_ids"]):
        raise ValueError(f"`{name}` has empty prompts; every row needs at least one prompt token.")
    return dataset


def handle_overlong_prompts(
    dataset: Dataset,
    name: str,
    args: SAEPPOConfig,
    *,
    tokenizer: PreTrainedTokenizerBase,
    warn: bool = True,
    stacklevel: int = 5,
) -> Dataset:
    """Apply ``args.overlong_prompts`` to the tokenised prompts longer than ``args.max_prompt_length``.

    ``tokenizer``: the one that encoded them (``"truncate"`` keeps the opening it writes, see
    :func:`~trl_sae.generation.inputs.truncate_prompt`). ``warn``: whether this process warns (the main
    one); ``stacklevel`` points the warning at user code.
    """
    max_length = args.max_prompt_length
    if max_length is None:
        return dataset
    lengths = [len(ids) for ids in dataset["input_ids"]]
    overlong = [i for i, length in enumerate(lengths) if length > max_length]
    if not overlong:
        return dataset
    longest = max(lengths)
    summary = (
        f"{len(overlong)} of {len(lengths)} prompts in `{name}` are longer than "
        f"max_prompt_length={max_length} tokens (the longest has {longest})"
    )
    if args.overlong_prompts == "error":
        raise ValueError(
            f"{summary}; raise max_prompt_length, shorten them, or set overlong_prompts='filter' (drop "
            "them) or 'truncate' (keep their opening and last tokens)."
        )
    if args.overlong_prompts == "truncate":
        # The middle goes: the opening (BOS, chat template's start) and the end (the generation prompt)
        # stay. It can drop the question itself, which is why it is not the default.
        openings = prompt_openings(tokenizer)
        truncated = [truncate_prompt(dataset[i]["input_ids"], max_length, openings) for i in overlong]
        if warn:
            warnings.warn(
                f"{summary}; truncating them to {max_length} tokens: their opening (BOS and chat "
                "template's start) and their last tokens.",
                stacklevel=stacklevel,
            )
        by_row = dict(zip(overlong, truncated, strict=True))
        return dataset.map(
            lambda row, index: {"input_ids": by_row.get(index, list(row["input_ids"]))}, with_indices=True
        )
    if len(overlong) == len(lengths):
        raise ValueError(
            f"every prompt in `{name}` is longer than max_prompt_length={max_length} tokens (the shortest "
            f"has {min(lengths)}); raise max_prompt_length or set overlong_prompts='truncate'."
        )
    if warn:
        warnings.warn(
            f"{summary}; dropping them (overlong_prompts='filter'), {len(lengths) - len(overlong)} remain. "
            "Raise max_prompt_length to keep them.",
            stacklevel=stacklevel,
        )
    dropped = set(overlong)
    return dataset.select([i for i in range(len(lengths)) if i not in dropped])


def derive_batch_sizes(args: SAEPPOConfig, train_dataset_len: int) -> tuple[int, int]:
    """Fill the batch sizes TRL's PPOConfig derives (``local_batch_size``, ``batch_size``, the mini-batch
    sizes, ``total_episodes``, ``num_total_batches``) from the per-process sizes and ``args.world_size``; return
    the prompts a step samples on this process and on all. Refuses a dataset smaller than one step."""
    if args.total_episodes is None:
        args.total_episodes = int(args.num_train_epochs * train_dataset_len * args.num_generations)
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.micro_batch_size = args.per_device_train_batch_size * args.world_size
    args.batch_size = args.local_batch_size * args.world_size
    args.mini_batch_size = args.batch_size // args.num_mini_batches
    args.local_mini_batch_size = args.local_batch_size // args.num_mini_batches
    args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    if args.max_steps and args.max_steps > 0:
        args.num_total_batches = args.max_steps
    local_prompts = args.local_batch_size // args.num_generations
    global_prompts = local_prompts * args.world_size
    if global_prompts > train_dataset_len:
        raise ValueError(
            f"`train_dataset` has {train_dataset_len} prompts but one step needs "
            f"{global_prompts} (per_device_train_batch_size x gradient_accumulation_steps x "
            "processes / num_generations); add prompts or lower the batch size."
        )
    return local_prompts, global_prompts
