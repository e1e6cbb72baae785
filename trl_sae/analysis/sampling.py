"""Sampling for the analyses: prompt rows, the pure-temperature generation config, sampled completions
with their log-probabilities, and TRL-style reward scoring. Prompt encoding, padding and stop tokens come
from :mod:`trl_sae.generation.inputs`, shared with the trainer, so the analysis samples the policy PPO trains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from trl_sae.generation.capture import generate_with_logprobs, pure_sampling_config
from trl_sae.generation.inputs import (
    encode_prompt,
    eval_mode,  # re-exported: the analyses' name for it; restores every submodule's own mode
    is_conversational,
    left_pad,
    model_device,
    model_stop_token_ids,
)

__all__ = [
    "Samples",
    "as_rows",
    "eval_mode",
    "sample_completions",
    "sampling_generation_config",
    "score_completions",
    "seeded",
    "stop_ids",
]

RewardFunc = Callable[..., list[float | None]]


# --------------------------------------------------------------------------------------------------
# Prompts, sampling and rewards
# --------------------------------------------------------------------------------------------------
def as_rows(prompts: Any) -> list[dict[str, Any]]:
    """Normalise a dataset / list of rows / list of prompts into rows that have a ``"prompt"`` key."""
    if hasattr(prompts, "to_list") and hasattr(prompts, "column_names"):  # a datasets.Dataset
        if "prompt" not in prompts.column_names:
            raise ValueError(f"The dataset needs a 'prompt' column; it has {prompts.column_names}.")
        items = prompts.to_list()
    else:
        items = list(prompts)
    if not items:
        raise ValueError("No prompts given; pass at least one prompt (str, chat messages, or a row dict).")
    rows = []
    for item in items:
        if isinstance(item, Mapping):
            if "prompt" not in item:
                raise ValueError(f"A prompt row must have a 'prompt' key; got keys {sorted(item)}.")
            rows.append(dict(item))
        else:
            rows.append({"prompt": item})
    return rows


def stop_ids(policy: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every EOS of ``policy`` (:func:`~trl_sae.generation.inputs.model_stop_token_ids`); sampling needs one."""
    ids = model_stop_token_ids(policy, tokenizer)
    if not ids:
        raise ValueError("Neither the policy's generation_config nor the tokenizer defines an eos token.")
    return ids


def sampling_generation_config(
    policy: torch.nn.Module, tokenizer: Any, temperature: float, max_new_tokens: int
) -> GenerationConfig:
    """Pure temperature sampling, ``softmax(logits / temperature)``: the policy PPO's logprobs describe.

    Every truncating or penalising field is set to its neutral value explicitly because ``generate`` fills
    each unset (``None``) field from the checkpoint's ``generation_config`` (Qwen3 ships ``top_k=20,
    top_p=0.95``, Qwen2.5 ``repetition_penalty=1.05``), which would silently analyse another policy.
    ``min_new_tokens`` would moreover restart at every continuation and make ``V*(s_t)`` the value of a
    different process than the trajectory's.
    """
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0 for Monte-Carlo sampling, got {temperature}.")
    if max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids(policy, tokenizer)[0]
    return pure_sampling_config(float(temperature), int(max_new_tokens), stop_ids(policy, tokenizer), pad)


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch for a reproducible run without clobbering the caller's global RNG state."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def score_completions(
    reward_func: RewardFunc,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    completion_ids: Sequence[Sequence[int]],
) -> np.ndarray:
    """Call a TRL-style reward function; ``(N,)`` float64 with NaN where it returned ``None``."""
    if not rows:
        return np.zeros(0)
    texts = tokenizer.batch_decode([list(c) for c in completion_ids], skip_special_tokens=True)
    prompts = [row["prompt"] for row in rows]
    # TRL's convention: a conversational prompt gets its completion as a list with one assistant message.
    completions = [
        [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
        for prompt, text in zip(prompts, texts)
    ]
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
    out = reward_func(
        prompts=prompts, completions=completions, completion_ids=[list(c) for c in completion_ids], **columns
    )
    if len(out) != len(rows):
        raise ValueError(f"The reward function returned {len(out)} rewards for {len(rows)} completions.")
    return np.array([math.nan if r is None else float(r) for r in out], dtype=float)


@dataclass
class Samples:
    """Sampled completions, one entry per trajectory (unpadded 1-D tensors on CPU)."""

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    completion_ids: list[torch.Tensor]  # (L_i,) long
    logprobs: list[torch.Tensor]  # (L_i,) float32, under the sampling distribution
    is_truncated: list[bool]


def sample_completions(
    policy: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    num_samples: int,
    generation_config: GenerationConfig,
    batch_size: int,
    show_progress: bool,
    desc: str = "trajectories",
) -> Samples:
    """Sample ``num_samples`` completions, cycling through ``rows`` in order (row ``j % len(rows)``)."""
    device = model_device(policy)
    encoded = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    for row, ids in zip(rows, encoded):
        if not ids:
            raise ValueError(
                f"Prompt {row['prompt']!r} tokenised to nothing; generation needs at least one token."
            )
    pad_id = generation_config.pad_token_id
    samples = Samples([], [], [], [], [])
    with tqdm(total=num_samples, desc=desc, unit="seq", disable=not show_progress) as bar:
        for start in range(0, num_samples, batch_size):
            index = [j % len(rows) for j in range(start, min(num_samples, start + batch_size))]
            input_ids, attention_mask = left_pad([encoded[j] for j in index], pad_id, device)
            out = generate_with_logprobs(policy, input_ids, attention_mask, generation_config)
            lengths = out.completion_mask.bool().sum(dim=1).tolist()
            for b, j in enumerate(index):
                samples.rows.append(rows[j])
                samples.prompt_ids.append(encoded[j])
                samples.completion_ids.append(out.completion_ids[b, : lengths[b]].detach().cpu().long())
                samples.logprobs.append(out.logprobs[b, : lengths[b]].detach().cpu().float())
                samples.is_truncated.append(bool(out.is_truncated[b]))
            bar.update(len(index))
    return samples
