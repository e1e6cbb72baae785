"""Set-up helpers for :class:`~trl_sae.SAEPPOTrainer` other than the models (those are in
:mod:`trl_sae.trainer.models`): the Accelerator and DeepSpeed's clipping, prompt datasets, the sampling
``GenerationConfig`` and the optimizer's parameter groups.

Plain functions of the config; the trainer's set-up phases (``_setup_accelerator``,
``_prepare_prompt_dataset``, ``_setup_generation``, ``create_optimizer``, ...) call them.
"""

from __future__ import annotations

import warnings
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from datasets import Dataset
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.trainer_utils import enable_full_determinism, set_seed
from transformers.utils import logging as hf_logging

from trl_sae.generation.inputs import encode_prompt
from trl_sae.trainer.config import SAEPPOConfig

__all__ = [
    "build_accelerator",
    "check_evaluation_setup",
    "configure_deepspeed_clipping",
    "deepspeed_gradient_clipping",
    "handle_overlong_prompts",
    "optimizer_param_groups",
    "tokenize_prompt_dataset",
]

logger = hf_logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------------
# Accelerator
# ----------------------------------------------------------------------------------------------------
def build_accelerator(args: SAEPPOConfig) -> Accelerator:
    """The Accelerator for ``args`` (DDP settings, mixed precision, CPU), after which the process's log level
    and seed are set as ``transformers.Trainer`` sets them."""
    ddp_kwargs: dict[str, Any] = {}
    if args.value_warmup_steps > 0:
        # Critic-only warm-up steps leave the policy's parameters unused in the backward pass.
        if args.ddp_find_unused_parameters is False:
            raise ValueError(
                "SAEPPOConfig.ddp_find_unused_parameters=False cannot work with value_warmup_steps > 0: the "
                "critic-only steps leave the policy's parameters out of the backward pass. Leave it unset."
            )
        ddp_kwargs["find_unused_parameters"] = True
    elif args.ddp_find_unused_parameters is not None:
        ddp_kwargs["find_unused_parameters"] = args.ddp_find_unused_parameters
    for name, key in (
        ("ddp_bucket_cap_mb", "bucket_cap_mb"),
        ("ddp_broadcast_buffers", "broadcast_buffers"),
        ("ddp_static_graph", "static_graph"),
    ):
        if getattr(args, name) is not None:
            ddp_kwargs[key] = getattr(args, name)
    kwargs_handlers = [DistributedDataParallelKwargs(**ddp_kwargs)] if ddp_kwargs else []
    mixed_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        cpu=args.use_cpu,
        kwargs_handlers=kwargs_handlers,
    )
    # As transformers.Trainer: the process's log level, and full determinism when asked for.
    hf_logging.set_verbosity(args.get_process_log_level())
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        set_seed(args.seed)
    return accelerator


def deepspeed_gradient_clipping(configured: Any, max_grad_norm: float | None) -> float:
    """The ``gradient_clipping`` value to put in DeepSpeed's config so that ``max_grad_norm`` holds.

    DeepSpeed clips gradients inside its engine step, and accelerate's ``clip_grad_norm_`` does nothing under
    DeepSpeed, so the trainer's separate actor / critic clipping cannot run there: DeepSpeed clips ONE global
    norm over the actor's and the critic's gradients together.

    Args:
        configured: the DeepSpeed config's ``gradient_clipping`` (``"auto"`` or absent: take ``max_grad_norm``;
            a number must agree with it).
        max_grad_norm: ``SAEPPOConfig.max_grad_norm``; ``None`` or ``<= 0`` disables clipping (DeepSpeed's 0).
    """
    wanted = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else 0.0
    if configured is None or configured == "auto":
        return wanted
    if float(configured) != wanted:
        raise ValueError(
            f"The DeepSpeed config sets gradient_clipping={configured} but SAEPPOConfig.max_grad_norm={max_grad_norm}; "
            "set gradient_clipping to 'auto' (or leave it out) so it follows max_grad_norm, or make them equal."
        )
    return wanted


def configure_deepspeed_clipping(accelerator: Accelerator, max_grad_norm: float | None) -> None:
    """Make DeepSpeed clip at ``max_grad_norm`` (one global norm: see :func:`deepspeed_gradient_clipping`);
    nothing without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    config["gradient_clipping"] = deepspeed_gradient_clipping(config.get("gradient_clipping"), max_grad_norm)
    if config["gradient_clipping"] > 0:
        logger.warning(
            f"DeepSpeed clips gradients itself: max_grad_norm={config['gradient_clipping']} applies to one global "
            "norm over the actor and the critic together, not to each separately as without DeepSpeed."
        )


# ----------------------------------------------------------------------------------------------------
# Prompt datasets
# ----------------------------------------------------------------------------------------------------
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
    dataset: Dataset, name: str, args: SAEPPOConfig, warn: bool = True, stacklevel: int = 5
) -> Dataset:
    """Apply ``args.overlong_prompts`` to the tokenised prompts longer than ``args.max_prompt_length``.

    ``warn``: whether this process warns (the main one); ``stacklevel`` points the warning at user code.
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
            "them) or 'truncate' (keep their last tokens)."
        )
    if args.overlong_prompts == "truncate":
        # Left truncation keeps the end of the prompt (a chat template's generation prompt); it can
        # drop the question itself, which is why it is not the default.
        if warn:
            warnings.warn(
                f"{summary}; truncating them to their last {max_length} tokens.", stacklevel=stacklevel
            )
        return dataset.map(lambda row: {"input_ids": list(row["input_ids"])[-max_length:]})
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


# ----------------------------------------------------------------------------------------------------
# Generation and optimizer
# ----------------------------------------------------------------------------------------------------
def optimizer_param_groups(
    wrapper: nn.Module, decay_names: set[str], args: SAEPPOConfig
) -> list[dict[str, Any]]:
    """Parameter groups: the actor at ``learning_rate`` and the critic at ``critic_learning_rate``, each
    split into weight-decayed (``decay_names``) and not; empty groups are left out.

    Args:
        wrapper: the policy-and-critic module (``actor_parameters()`` / ``critic_parameters()``).
        decay_names: names (in ``wrapper``) of the parameters that take ``args.weight_decay``.
    """
    names = {id(p): n for n, p in wrapper.named_parameters()}
    groups = []
    for params, lr in (
        (wrapper.actor_parameters(), args.learning_rate),
        (wrapper.critic_parameters(), args.critic_learning_rate),
    ):
        for decay in (True, False):
            chosen = [p for p in params if (names[id(p)] in decay_names) == decay]
            if chosen:
                groups.append(
                    {"params": chosen, "lr": lr, "weight_decay": args.weight_decay if decay else 0.0}
                )
    return groups
