"""A brief supervised warm start (SFT) on worked solutions, before RL.

Why a plain torch loop and not TRL's ``SFTTrainer``: ``SFTTrainer`` (trl 1.12) does work offline with the
tiny model and the char tokenizer in prompt-completion format with completion-only loss, but at this
scale its fixed per-step machinery (accelerate, callbacks, logging metrics such as entropy and token
accuracy over the vocabulary) costs far more than the few-millisecond forward/backward it wraps. On the
shared 2-core machine, 200 steps (hidden 64, 2 layers, batch 32) took 237 s in ``SFTTrainer`` (about
10 steps/s in its quietest stretch, torch's default 2 threads) against 25 s for this loop (1 thread,
similar load; the loop alone reaches ~23 steps/s when the machine is quiet), and the demo's budget for building the model and warm-starting it is about 40 s. The loop keeps the same
semantics: the chat template renders the prompt with the generation prompt appended, the completion is
the demonstration followed by the end-of-turn token, and only completion tokens carry loss.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from trl_sae.generation.inputs import encode_prompt, model_device, right_pad

if TYPE_CHECKING:
    from datasets import Dataset

    from trl_sae.demo.tasks import DemoDefaults

__all__ = [
    "DemoSetup",
    "prepare_demo",
    "sft_loss",
    "sft_warm_start",
    "tokenize_sft_examples",
    "warm_start_on_splits",
]


def tokenize_sft_examples(
    tokenizer: Any, prompts: list[Any], completions: list[str]
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per example: prompt + completion + EOS, labels -100 on the prompt.

    The completion ends with the tokenizer's EOS (the chat end-of-turn token for Qwen-style tokenizers)
    so the model learns to stop, which generation relies on.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has no eos_token_id; the warm start needs one to teach stopping.")
    examples = []
    for prompt, completion in zip(prompts, completions):
        prompt_ids = encode_prompt(tokenizer, prompt)
        completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        completion_ids.append(tokenizer.eos_token_id)
        examples.append((prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids))
    return examples


def _collate(
    batch: list[tuple[list[int], list[int]]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Right padding for training: positions then start at 0 for every row without position_ids juggling.
    input_ids = right_pad([ids for ids, _ in batch], pad_token_id)
    labels = right_pad([labs for _, labs in batch], -100)
    attention_mask = right_pad([[1] * len(ids) for ids, _ in batch], 0)
    return input_ids, attention_mask, labels


def sft_loss(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy over the completion tokens (labels != -100)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    # Predict token t+1 from positions <= t.
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    return nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100
    )


def sft_warm_start(
    model: nn.Module,
    tokenizer: Any,
    dataset: Any,
    max_steps: int = 200,
    learning_rate: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
    completion_column: str = "solution",
    prompt_column: str = "prompt",
    warmup_steps: int = 10,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    progress: bool = True,
    log_every: int = 0,
    callback: Callable[[int, float], None] | None = None,
) -> nn.Module:
    """Supervised fine-tuning on ``dataset[completion_column]`` with completion-only loss.

    AdamW with linear warm-up then cosine decay to 0 over ``max_steps``. Batches are drawn by walking
    shuffled epochs of the dataset; the shuffles, and therefore the whole run on a given machine, are
    fixed by ``seed``.

    Args:
        model: a causal LM (trained in place and returned, in eval mode).
        tokenizer: its tokenizer (chat template needed for chat prompts).
        dataset: rows with ``prompt_column`` (chat messages or text) and ``completion_column`` (text).
        max_steps: optimizer steps.
        learning_rate: peak learning rate.
        batch_size: sequences per step.
        seed: seeds the data order (and torch's RNG, for dropout if the model has any).
        completion_column: the column with the target completion text.
        prompt_column: the column with the prompt.
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW weight decay.
        max_grad_norm: gradient clipping norm (``<= 0`` disables it).
        progress: show a tqdm bar with the running loss.
        log_every: if > 0, also write the smoothed loss to the bar's log every this many steps.
        callback: called as ``callback(step, loss)`` after every step (e.g. to record a loss curve).

    Returns:
        The same ``model``.
    """
    if max_steps < 0:
        raise ValueError(f"`max_steps` must be >= 0, got {max_steps}.")
    if len(dataset) == 0:
        raise ValueError("The warm-start dataset is empty.")
    for column in (prompt_column, completion_column):
        if column not in dataset.column_names:
            raise ValueError(f"The dataset has no {column!r} column (columns: {dataset.column_names}).")
    if max_steps == 0:
        return model.eval()

    torch.manual_seed(seed)
    rng = random.Random(seed)
    examples = tokenize_sft_examples(
        tokenizer, list(dataset[prompt_column]), list(dataset[completion_column])
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = model_device(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress_frac = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress_frac)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    order: list[int] = []
    model.train()
    bar = tqdm(range(max_steps), desc="SFT warm start", disable=not progress, leave=False)
    smoothed = None
    for step in bar:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        input_ids, attention_mask, labels = (t.to(device) for t in _collate(batch, pad_id))
        loss = sft_loss(model, input_ids, attention_mask, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        value = float(loss.detach())
        smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
        bar.set_postfix(loss=f"{smoothed:.3f}")
        if log_every > 0 and (step + 1) % log_every == 0:
            bar.write(f"SFT step {step + 1}/{max_steps}: loss {smoothed:.4f}")
        if callback is not None:
            callback(step, value)
    model.eval()
    return model


@dataclass
class DemoSetup:
    """What ``prepare_demo`` hands to the RL stage."""

    model: nn.Module
    tokenizer: Any
    train_dataset: Dataset
    test_dataset: Dataset
    defaults: DemoDefaults
    sft_seconds: float
    sft_losses: list[float] = field(default_factory=list)


def prepare_demo(defaults: DemoDefaults | None = None, progress: bool = True) -> DemoSetup:
    """Everything before PPO in ``trl-sae demo``: task splits, a tiny Qwen3, and its SFT warm start.

    Deterministic in ``defaults.seed`` (data, initialisation and data order). The train split's
    ``solution`` column holds the sloppy teacher's demonstrations; the test split has correct references.

    Args:
        defaults: the recipe; ``trl_sae.demo.tasks.DEMO_DEFAULTS`` (measured, see its comment) if None.
        progress: show the warm start's progress bar.

    Returns:
        A ``DemoSetup`` with the warm-started model (eval mode), the char tokenizer, both splits, the
        wall-clock seconds of model build + SFT, and the per-step SFT losses.
    """
    from trl_sae.demo.tasks import DEMO_DEFAULTS, make_running_sum_splits

    defaults = defaults or DEMO_DEFAULTS
    splits = make_running_sum_splits(
        defaults.n_train,
        defaults.n_test,
        num_terms=defaults.num_terms,
        max_value=defaults.max_value,
        seed=defaults.seed,
        variant=defaults.variant,
        teacher_error_rate=defaults.teacher_error_rate,
    )
    return warm_start_on_splits(splits, defaults, progress)


def warm_start_on_splits(splits: dict[str, Any], defaults: Any, progress: bool = True) -> DemoSetup:
    """A tiny Qwen3 and the char tokenizer, warm-started by SFT on ``splits["train"]``'s ``solution`` column.

    Shared by every demo task (``prepare_demo``, the decision task's ``prepare_walk_demo``). ``defaults``
    is the task's settings object with the model and SFT fields of ``DemoDefaults`` (``hidden_size``,
    ``num_layers``, ``num_heads``, ``seed``, ``sft_*``); it is stored in the returned ``DemoSetup``.
    """
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer()
    start = time.perf_counter()
    model = build_tiny_qwen3(
        tokenizer,
        hidden_size=defaults.hidden_size,
        num_layers=defaults.num_layers,
        num_heads=defaults.num_heads,
        seed=defaults.seed,
        head_dim=getattr(defaults, "head_dim", None),
    )
    losses: list[float] = []
    sft_warm_start(
        model,
        tokenizer,
        splits["train"],
        max_steps=defaults.sft_max_steps,
        learning_rate=defaults.sft_learning_rate,
        batch_size=defaults.sft_batch_size,
        seed=defaults.seed,
        warmup_steps=defaults.sft_warmup_steps,
        progress=progress,
        callback=lambda step, loss: losses.append(loss),
    )
    return DemoSetup(
        model=model,
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        test_dataset=splits["test"],
        defaults=defaults,
        sft_seconds=time.perf_counter() - start,
        sft_losses=losses,
    )
