"""Monte-Carlo state values ``V*(s)``: ``K`` continuations of each state with the policy, scored by the
verifiable reward, sharing one prefilled KV cache per state."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig

from trl_sae.analysis.sampling import (
    RewardFunc,
    eval_mode,
    sampling_generation_config,
    score_completions,
    stop_ids,
)
from trl_sae.generation.inputs import left_pad, model_device

__all__ = ["MonteCarloValues", "monte_carlo_values"]


# --------------------------------------------------------------------------------------------------
# Monte-Carlo state values
# --------------------------------------------------------------------------------------------------
@dataclass
class MonteCarloValues:
    """Monte-Carlo value estimates of a list of states.

    Attributes:
        values: ``(S,)`` mean reward of the continuations (NaN where every reward was ``None``).
        num_valid: ``(S,)`` continuations whose reward was not ``None`` (1 for a terminal state).
        std: ``(S,)`` sample standard deviation of those rewards (0 for a terminal state).
    """

    values: np.ndarray
    num_valid: np.ndarray
    std: np.ndarray


def _prefill_cache(
    policy: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> DynamicCache:
    """KV cache of every token but the last of each left-padded row (``generate`` feeds the last)."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    cache = DynamicCache(config=policy.config)
    policy(
        input_ids=input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :-1],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,  # only the cache is wanted; full (B, P, V) logits would dwarf it
    )
    return cache


def monte_carlo_values(
    policy: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    prompt_ids: Sequence[Sequence[int]],
    prefix_ids: Sequence[Sequence[int]],
    budgets: Sequence[int],
    reward_func: RewardFunc,
    num_continuations: int = 32,
    temperature: float = 1.0,
    batch_size: int = 64,
    reuse_prefix_cache: bool = True,
    show_progress: bool = True,
) -> MonteCarloValues:
    """``V*(s)`` of states ``s = prompt + prefix`` by ``K`` continuations with the policy, scored by the reward.

    A continuation is sampled with pure temperature sampling and may generate at most ``budgets[s]`` more
    tokens (``max_new_tokens - len(prefix)`` for the horizon of the original rollout, so ``V*`` is the value
    in the same finite-horizon MDP); it stops at eos. The scored completion is ``prefix + continuation``.
    A state whose budget is 0 or whose prefix ends with eos is terminal: its value is its own reward.

    Batching: the ``K`` copies of a state, and several states, share one ``generate`` call of at most
    ``batch_size`` rows (a state's ``K`` are split over calls when ``K > batch_size``). States are sorted by
    budget so a call's rows have similar horizons; a call generates up to the largest budget in it and
    each row is cut to its own budget afterwards, which is the same distribution as stopping there.
    With ``reuse_prefix_cache`` the distinct states of a call are prefilled once and their KV cache is
    expanded to the ``K`` rows (``generate`` then only runs the last prompt token), saving ``K - 1``
    prefills per state; models whose cache cannot be built or indexed that way fall back to plain
    batching with a warning.

    Args:
        policy: causal LM.
        tokenizer: its tokenizer (decodes completions for the reward function).
        rows: ``S`` prompt rows (``"prompt"`` plus the columns the reward function reads, e.g. ``answer``).
        prompt_ids: ``S`` unpadded prompt token ids.
        prefix_ids: ``S`` completion prefixes (``completion[:t]``).
        budgets: ``S`` numbers of tokens a continuation may still generate.
        reward_func: ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``.
        num_continuations: ``K``.
        temperature: sampling temperature, the rollout's.
        batch_size: rows per ``generate`` call.
        reuse_prefix_cache: prefill each state once and share its KV cache among its ``K`` copies.
        show_progress: tqdm bar counting continuations.

    Returns:
        :class:`MonteCarloValues` with ``(S,)`` arrays.
    """
    num_states = len(prompt_ids)
    if not (len(rows) == len(prefix_ids) == len(budgets) == num_states):
        raise ValueError("`rows`, `prompt_ids`, `prefix_ids` and `budgets` must have the same length.")
    if num_continuations < 1 or batch_size < 1:
        raise ValueError("`num_continuations` and `batch_size` must be >= 1.")
    eos = set(stop_ids(policy, tokenizer))
    device = model_device(policy)
    sums = np.zeros(num_states)
    sq_sums = np.zeros(num_states)
    counts = np.zeros(num_states, dtype=np.int64)
    terminal = [
        budgets[s] <= 0 or (len(prefix_ids[s]) > 0 and int(prefix_ids[s][-1]) in eos)
        for s in range(num_states)
    ]
    terminal_states = [s for s in range(num_states) if terminal[s]]
    if terminal_states:
        rewards = score_completions(
            reward_func,
            tokenizer,
            [rows[s] for s in terminal_states],
            [prefix_ids[s] for s in terminal_states],
        )
        for s, r in zip(terminal_states, rewards):
            if not math.isnan(r):
                sums[s], sq_sums[s], counts[s] = r, r * r, 1

    # Longest horizon first: rows of a call then have similar budgets and little wasted generation.
    order = sorted(
        (s for s in range(num_states) if not terminal[s]),
        key=lambda s: (-int(budgets[s]), -len(prompt_ids[s]) - len(prefix_ids[s])),
    )
    jobs = [s for s in order for _ in range(num_continuations)]  # one entry per continuation row
    base_config = sampling_generation_config(policy, tokenizer, temperature, max(1, max(budgets, default=1)))
    use_cache = reuse_prefix_cache
    with (
        tqdm(total=len(jobs), desc="MC continuations", unit="cont", disable=not show_progress) as bar,
        eval_mode(policy),
        torch.inference_mode(),
    ):
        for start in range(0, len(jobs), batch_size):
            call_rows = jobs[start : start + batch_size]
            unique = list(dict.fromkeys(call_rows))
            state_pos = {s: i for i, s in enumerate(unique)}
            row_to_unique = torch.tensor([state_pos[s] for s in call_rows], device=device)
            seqs = [list(prompt_ids[s]) + [int(t) for t in prefix_ids[s]] for s in unique]
            input_ids, attention_mask = left_pad(seqs, base_config.pad_token_id, device)
            config = GenerationConfig(**base_config.to_dict())
            config.max_new_tokens = max(int(budgets[s]) for s in unique)
            config.cache_implementation = None  # a prefilled cache is passed instead
            cache = None
            if use_cache and input_ids.shape[1] > 1:
                try:
                    cache = _prefill_cache(policy, input_ids, attention_mask)
                    cache.batch_select_indices(row_to_unique)  # expand each state to its K rows
                except (TypeError, ValueError, NotImplementedError, AttributeError) as error:
                    warnings.warn(
                        f"Could not reuse the prefix KV cache for this model ({error!r}); continuations are "
                        "batched without it (same samples' distribution, K times the prefill cost).",
                        stacklevel=2,
                    )
                    use_cache, cache = False, None
            generate_kwargs = {"past_key_values": cache} if cache is not None else {}
            out = policy.generate(
                input_ids=input_ids[row_to_unique],
                attention_mask=attention_mask[row_to_unique],
                generation_config=config,
                **generate_kwargs,
            )
            new_tokens = out[:, input_ids.shape[1] :].tolist()
            completions = []
            for s, tokens in zip(call_rows, new_tokens):
                tokens = tokens[: int(budgets[s])]
                for k, token in enumerate(tokens):  # keep the eos, drop the padding after it
                    if token in eos:
                        tokens = tokens[: k + 1]
                        break
                completions.append([int(t) for t in prefix_ids[s]] + tokens)
            rewards = score_completions(reward_func, tokenizer, [rows[s] for s in call_rows], completions)
            for s, r in zip(call_rows, rewards):
                if not math.isnan(r):  # a None reward is "not applicable", not 0
                    sums[s] += r
                    sq_sums[s] += r * r
                    counts[s] += 1
            bar.update(len(call_rows))

    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        variance = np.where(counts > 1, (sq_sums - counts * values**2) / np.maximum(counts - 1, 1), 0.0)
    return MonteCarloValues(values=values, num_valid=counts, std=np.sqrt(np.clip(variance, 0.0, None)))
