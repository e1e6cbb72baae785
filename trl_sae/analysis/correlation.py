"""Advantage quality: correlation of each estimator with a Monte-Carlo ground-truth advantage ``A*``.

This is the analysis of the paper's Section 5.3.2 ("Correlation with an Approximate Ground-Truth
Advantage", Figure 4):

1. Sample trajectories from the policy at a temperature (:func:`trl_sae.generation.capture.generate_with_logprobs`,
   which also gives each sampled token's log-probability, hence the probability boundaries).
2. Pick random spans ``[t, t + m]`` whose two ends are segment starts (see :func:`pick_spans`).
3. From each end state ``s_t`` (prompt + ``completion[:t]``) run ``K`` Monte-Carlo continuations to the
   end with the same policy and temperature, score them with the verifiable reward, and average:
   ``V*(s_t)`` (:func:`monte_carlo_values`). ``A* = V*(s_{t+m}) - V*(s_t)`` is assigned to every token of
   the span (tokens ``t .. t+m-1``, the actions that move ``s_t`` to ``s_{t+m}``).
4. For the same tokens compute every estimator's advantage from a critic (GAE over a lambda grid, SAE
   over a ``p`` grid, VAPO's adaptive lambda) with the outcome reward on the last valid token.
5. Report the Pearson correlation of each estimator with ``A*`` over all span tokens, with a bootstrap
   confidence interval that resamples spans, not tokens (:func:`pearson_with_bootstrap`): the tokens of
   one span share one ``A*``, so resampling tokens would pretend to have far more independent data.

Index conventions follow ``DESIGN.md``: completion position ``t`` is the ``t``-th generated token, the
state *before* it is ``s_t``, ``values[t] = V(s_t)``, and ``s_L`` (after the last valid token) is terminal.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig

from trl_sae.core.advantages import adaptive_lambda, gae_advantages, sae_advantages
from trl_sae.core.segmentation import probability_boundaries
from trl_sae.generation.capture import generate_with_logprobs
from trl_sae.generation.inputs import (
    encode_prompt,
    is_conversational,
    left_pad,
    model_device,
    model_stop_token_ids,
    right_pad,
)

__all__ = [
    "DEFAULT_LAM_GRID",
    "DEFAULT_P_GRID",
    "BootstrapPearson",
    "CorrelationResult",
    "CorrelationRow",
    "MonteCarloValues",
    "SpanRecord",
    "correlate_advantages",
    "critic_value_fn",
    "estimator_advantages",
    "monte_carlo_values",
    "pearson_with_bootstrap",
    "pick_spans",
    "sampling_generation_config",
    "segment_anchors",
]

# The grids of the paper's Figure 4: GAE as a function of lambda (right panel) and SAE for the p values
# of its threshold ablation.
DEFAULT_LAM_GRID: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)
DEFAULT_P_GRID: tuple[float, ...] = (0.05, 0.2, 0.5, 0.9)

RewardFunc = Callable[..., list[float | None]]
ValueFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Pearson correlation with a cluster bootstrap
# --------------------------------------------------------------------------------------------------
class BootstrapPearson(NamedTuple):
    """Pearson correlation and the percentile bootstrap confidence interval around it."""

    pearson: float
    ci_low: float
    ci_high: float


def _pearson_from_sums(stats: np.ndarray) -> np.ndarray:
    """Pearson from sufficient statistics ``(..., 6)`` = ``(n, Sx, Sy, Sxx, Syy, Sxy)``; NaN if degenerate."""
    n, sx, sy, sxx, syy, sxy = np.moveaxis(stats, -1, 0)
    cov = n * sxy - sx * sy
    var_x = n * sxx - sx * sx
    var_y = n * syy - sy * sy
    denom = np.sqrt(np.clip(var_x, 0.0, None) * np.clip(var_y, 0.0, None))
    # A relative floor instead of `== 0`: a constant input leaves only rounding noise in var_x.
    scale = np.sqrt(np.abs(n * sxx) * np.abs(n * syy)) + 1e-300
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(denom > 1e-12 * scale, cov / np.where(denom > 0, denom, 1.0), np.nan)
    return np.clip(r, -1.0, 1.0)


def pearson_with_bootstrap(
    x: np.ndarray | Sequence[float] | torch.Tensor,
    y: np.ndarray | Sequence[float] | torch.Tensor,
    groups: np.ndarray | Sequence[int] | torch.Tensor | None = None,
    num_resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> BootstrapPearson:
    """Pearson correlation of ``x`` and ``y`` with a cluster (group) bootstrap confidence interval.

    Each resample draws as many groups as there are, uniformly with replacement, and takes all points of
    each drawn group (a group drawn twice counts twice). Points within a group are not independent (in
    the correlation analysis every token of a span shares the span's ``A*``), so resampling whole groups
    is what gives an honest interval. Computed from per-group sufficient statistics, so a resample costs
    ``O(num_groups)``, not ``O(num_points)``.

    Args:
        x: ``(N,)`` values.
        y: ``(N,)`` values.
        groups: ``(N,)`` group label of each point (any hashable ints); ``None`` makes every point its own
            group (the ordinary bootstrap).
        num_resamples: bootstrap resamples; 0 skips the interval (NaN bounds).
        seed: seed of the resampling generator (the interval is reproducible).
        confidence: two-sided level of the percentile interval, in (0, 1).

    Returns:
        ``BootstrapPearson(pearson, ci_low, ci_high)``; NaN where a variance is zero or ``N < 2``.
    """
    x = np.asarray(torch.as_tensor(x).detach().cpu().double().numpy() if torch.is_tensor(x) else x, float)
    y = np.asarray(torch.as_tensor(y).detach().cpu().double().numpy() if torch.is_tensor(y) else y, float)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"`x` and `y` must be 1-D of the same length; got {x.shape} and {y.shape}.")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence}.")
    if num_resamples < 0:
        raise ValueError(f"`num_resamples` must be >= 0, got {num_resamples}.")
    if groups is None:
        group_index = np.arange(x.shape[0])
    else:
        groups = np.asarray(groups.cpu().numpy() if torch.is_tensor(groups) else groups)
        if groups.shape != x.shape:
            raise ValueError(f"`groups` must have shape {x.shape} like `x`; got {groups.shape}.")
        _, group_index = np.unique(groups, return_inverse=True)
    if x.shape[0] < 2:
        return BootstrapPearson(math.nan, math.nan, math.nan)
    # Centre first: sums of squares of uncentred data lose precision when the mean dwarfs the spread.
    xc, yc = x - x.mean(), y - y.mean()
    num_groups = int(group_index.max()) + 1
    per_point = np.stack([np.ones_like(xc), xc, yc, xc * xc, yc * yc, xc * yc], axis=1)
    group_stats = np.zeros((num_groups, 6))
    np.add.at(group_stats, group_index, per_point)
    pearson = float(_pearson_from_sums(group_stats.sum(axis=0)))
    if num_resamples == 0 or num_groups < 2:
        return BootstrapPearson(pearson, math.nan, math.nan)

    rng = np.random.default_rng(seed)
    samples = np.empty(num_resamples)
    # Chunks bound the (chunk, num_groups) count matrix to a few MB whatever the number of spans.
    chunk = max(1, min(num_resamples, 2_000_000 // num_groups))
    uniform = np.full(num_groups, 1.0 / num_groups)
    for start in range(0, num_resamples, chunk):
        stop = min(num_resamples, start + chunk)
        counts = rng.multinomial(num_groups, uniform, size=stop - start).astype(float)
        samples[start:stop] = _pearson_from_sums(counts @ group_stats)
    if np.isnan(samples).all():
        return BootstrapPearson(pearson, math.nan, math.nan)
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.nanpercentile(samples, [tail, 100.0 - tail])
    return BootstrapPearson(pearson, float(low), float(high))


# --------------------------------------------------------------------------------------------------
# Span picking
# --------------------------------------------------------------------------------------------------
def segment_anchors(boundaries: torch.Tensor | np.ndarray | Sequence[bool], length: int) -> list[int]:
    """Positions of the states that start a segment or end the response.

    ``0`` (the first token always opens a segment), every ``t`` in ``[1, length)`` with ``boundaries[t]``
    (token ``t`` opens a segment, so ``s_t`` is the state at the segment's start), and ``length`` (the
    terminal state ``s_L``).

    Args:
        boundaries: ``(T,)`` bool for one response, ``T >= length``; positions ``>= length`` are ignored.
        length: the response's valid length ``L >= 1``.

    Returns:
        Sorted positions, ``[0, ..., L]``.
    """
    if length < 1:
        raise ValueError(f"`length` must be >= 1, got {length}.")
    flags = torch.as_tensor(
        np.asarray(boundaries, dtype=bool) if not torch.is_tensor(boundaries) else boundaries
    )
    inner = torch.nonzero(flags[1:length].bool()).flatten() + 1
    return [0, *inner.tolist(), int(length)]


def pick_spans(
    boundaries: torch.Tensor | np.ndarray | Sequence[bool],
    length: int,
    num_spans: int,
    rng: np.random.Generator,
) -> list[tuple[int, int]]:
    """Draw spans of one response for the ``A*`` analysis.

    The rule: the response is cut into segments by :func:`segment_anchors` (boundaries at a threshold
    ``p``, plus the start and the end of the response); a span is one whole segment ``[t, t + m)`` between
    consecutive anchors, and ``min(num_spans, number of segments)`` distinct segments are drawn uniformly
    without replacement. Spans therefore never overlap (no token gets two ``A*``), both ends are segment
    starts or the end of the response, and span length follows the segment-length distribution of the
    chosen ``p`` (a smaller ``p`` gives longer spans).

    Args:
        boundaries: ``(T,)`` bool, True where token ``t`` opens a segment.
        length: valid length ``L >= 1`` of the response.
        num_spans: spans wanted (fewer come back if the response has fewer segments).
        rng: the seeded generator that draws them.

    Returns:
        ``[(start, end), ...]`` sorted by start; tokens ``start .. end-1`` belong to the span.
    """
    if num_spans < 0:
        raise ValueError(f"`num_spans` must be >= 0, got {num_spans}.")
    anchors = segment_anchors(boundaries, length)
    segments = list(pairwise(anchors))
    chosen = rng.choice(len(segments), size=min(num_spans, len(segments)), replace=False)
    return sorted(segments[int(i)] for i in chosen)


# --------------------------------------------------------------------------------------------------
# Prompts, sampling and rewards
# --------------------------------------------------------------------------------------------------
def _as_rows(prompts: Any) -> list[dict[str, Any]]:
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


def _stop_ids(policy: torch.nn.Module, tokenizer: Any) -> list[int]:
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
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _stop_ids(policy, tokenizer)[0]
    return GenerationConfig(
        do_sample=True,
        temperature=float(temperature),
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_length=0,
        min_new_tokens=0,
        max_new_tokens=int(max_new_tokens),
        pad_token_id=pad,
        eos_token_id=_stop_ids(policy, tokenizer),
    )


@contextmanager
def _eval_mode(*models: torch.nn.Module | None) -> Iterator[None]:
    """Dropout off while measuring; the caller's train/eval flags come back afterwards."""
    states = [(m, m.training) for m in models if isinstance(m, torch.nn.Module)]
    for model, _ in states:
        model.eval()
    try:
        yield
    finally:
        for model, was_training in states:
            model.train(was_training)


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch for a reproducible run without clobbering the caller's global RNG state."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _score(
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
class _Samples:
    """Sampled completions, one entry per trajectory (unpadded 1-D tensors on CPU)."""

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    completion_ids: list[torch.Tensor]  # (L_i,) long
    logprobs: list[torch.Tensor]  # (L_i,) float32, under the sampling distribution
    is_truncated: list[bool]


def _sample_completions(
    policy: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    num_samples: int,
    generation_config: GenerationConfig,
    batch_size: int,
    show_progress: bool,
    desc: str = "trajectories",
) -> _Samples:
    """Sample ``num_samples`` completions, cycling through ``rows`` in order (row ``j % len(rows)``)."""
    device = model_device(policy)
    encoded = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    for row, ids in zip(rows, encoded):
        if not ids:
            raise ValueError(
                f"Prompt {row['prompt']!r} tokenised to nothing; generation needs at least one token."
            )
    pad_id = generation_config.pad_token_id
    samples = _Samples([], [], [], [], [])
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
    eos = set(_stop_ids(policy, tokenizer))
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
        rewards = _score(
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
        _eval_mode(policy),
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
            rewards = _score(reward_func, tokenizer, [rows[s] for s in call_rows], completions)
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


# --------------------------------------------------------------------------------------------------
# Critic values and the estimators under comparison
# --------------------------------------------------------------------------------------------------
def critic_value_fn(critic_model: torch.nn.Module) -> ValueFn:
    """Adapt a one-label sequence-classification critic into a ``value_fn``.

    As TRL's PPO does: run the critic's backbone on ``prompt + completion`` and apply its ``score`` head to
    every hidden state; the value of ``s_t`` (before completion token ``t``) is the head at position
    ``P - 1 + t``, the last position the state contains.

    Args:
        critic_model: e.g. ``Qwen3ForSequenceClassification`` with ``num_labels=1`` (a backbone under
            ``base_model_prefix`` and a ``score`` linear head).

    Returns:
        ``value_fn(sequences (B, P+T), attention_mask (B, P+T), prompt_length P) -> values (B, T)`` float32.
    """
    prefix = getattr(critic_model, "base_model_prefix", "model")
    backbone = getattr(critic_model, prefix, None)
    head = getattr(critic_model, "score", None)
    if backbone is None or head is None:
        raise ValueError(
            f"{type(critic_model).__name__} has no `{prefix}` backbone and `score` head; pass your own "
            "`value_fn(sequences, attention_mask, prompt_length) -> (B, T)` instead."
        )

    def value_fn(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        # Left-padded prompts: positions count valid tokens only, as during generation.
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp_min(0)
        with _eval_mode(critic_model):
            hidden = backbone(
                input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
            scores = head(hidden).squeeze(-1).float()  # (B, P+T)
        return scores[:, prompt_length - 1 : -1]

    return value_fn


def _fmt(value: float) -> str:
    return f"{value:g}"


def estimator_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    lam_grid: Sequence[float] = DEFAULT_LAM_GRID,
    p_grid: Sequence[float] = DEFAULT_P_GRID,
    sae_lam: float = 0.95,
    adaptive_lambda_alpha: float = 0.2,
    gamma: float = 1.0,
) -> dict[tuple[str, str], torch.Tensor]:
    """Every compared estimator's advantages on one batch.

    Args:
        rewards: ``(B, T)`` token rewards (outcome reward on the last valid token).
        values: ``(B, T)`` critic values of the state before each token.
        mask: ``(B, T)`` 1 on valid tokens (right padding).
        logprobs: ``(B, T)`` rollout log-probabilities of the sampled tokens (for SAE's boundaries).
        lam_grid: GAE lambdas.
        p_grid: SAE probability thresholds.
        sae_lam: SAE's lambda.
        adaptive_lambda_alpha: VAPO's alpha in ``lam = 1 - 1 / (alpha * L)``.
        gamma: discount.

    Returns:
        ``{(estimator, setting): (B, T) advantages}``, ordered GAE, SAE, adaptive lambda.
    """
    out: dict[tuple[str, str], torch.Tensor] = {}
    for lam in lam_grid:
        out[("gae", f"lam={_fmt(lam)}")] = gae_advantages(rewards, values, mask, lam=float(lam), gamma=gamma)[
            0
        ]
    for p in p_grid:
        boundaries = probability_boundaries(logprobs, mask, threshold=float(p))
        out[("sae", f"p={_fmt(p)}, lam={_fmt(sae_lam)}")] = sae_advantages(
            rewards, values, mask, boundaries, lam=float(sae_lam), gamma=gamma
        )[0]
    lam_adaptive = adaptive_lambda(mask.bool().sum(dim=1), alpha=adaptive_lambda_alpha)
    out[("adaptive_lambda", f"alpha={_fmt(adaptive_lambda_alpha)}")] = gae_advantages(
        rewards, values, mask, lam=lam_adaptive, gamma=gamma
    )[0]
    return out


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclass
class CorrelationRow:
    """One estimator's correlation with ``A*``."""

    estimator: str
    setting: str
    pearson: float
    ci_low: float
    ci_high: float
    n_tokens: int
    n_spans: int

    @property
    def label(self) -> str:
        return f"{self.estimator}({self.setting})"


@dataclass
class SpanRecord:
    """One analysed span: tokens ``start .. end-1`` of trajectory ``trajectory``, ``A* = v_end - v_start``."""

    trajectory: int
    start: int
    end: int
    v_start: float
    v_end: float

    @property
    def a_star(self) -> float:
        return self.v_end - self.v_start


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


@dataclass
class CorrelationResult:
    """Output of :func:`correlate_advantages`.

    Attributes:
        rows: one :class:`CorrelationRow` per estimator setting, in the order GAE (lambda grid), SAE
            (p grid), adaptive lambda.
        a_star: ``(N,)`` ``A*`` of every span token.
        estimates: ``{row label: (N,) advantages}`` aligned with ``a_star``.
        span_ids: ``(N,)`` index into ``spans`` of each token (the bootstrap's groups).
        spans: the analysed spans.
        trajectory_rewards: ``(num_trajectories,)`` outcome reward of each sampled trajectory (NaN = None).
        config: the run's settings.
    """

    rows: list[CorrelationRow]
    a_star: np.ndarray
    estimates: dict[str, np.ndarray]
    span_ids: np.ndarray
    spans: list[SpanRecord]
    trajectory_rewards: np.ndarray
    config: dict[str, Any] = field(default_factory=dict)

    def row(self, estimator: str, setting: str | None = None) -> CorrelationRow:
        """The row of ``estimator`` (and ``setting``, needed when the estimator has several)."""
        matches = [r for r in self.rows if r.estimator == estimator and setting in (None, r.setting)]
        if len(matches) != 1:
            options = [r.label for r in self.rows if r.estimator == estimator]
            raise KeyError(
                f"{estimator!r} setting {setting!r} matches {len(matches)} rows; options: {options}"
            )
        return matches[0]

    def to_dict(self, include_arrays: bool = False) -> dict[str, Any]:
        """Rows and config (and, optionally, the per-token arrays) as plain Python, NaN as ``None``."""
        out: dict[str, Any] = {
            "rows": [asdict(r) for r in self.rows],
            "n_tokens": int(self.a_star.shape[0]),
            "n_spans": len(self.spans),
            "config": self.config,
        }
        if include_arrays:
            out["a_star"] = self.a_star
            out["estimates"] = self.estimates
            out["span_ids"] = self.span_ids
            out["spans"] = [asdict(s) for s in self.spans]
            out["trajectory_rewards"] = self.trajectory_rewards
        return _jsonable(out)

    def to_json(self, path: str | None = None, include_arrays: bool = False, indent: int = 2) -> str:
        """JSON text of :meth:`to_dict`; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(include_arrays=include_arrays), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        return text

    def to_markdown(self) -> str:
        """A Markdown table, one row per estimator setting."""
        level = self.config.get("confidence", 0.95)
        lines = [
            f"| estimator | setting | Pearson r | {100 * level:g}% CI | tokens | spans |",
            "|---|---|---:|---|---:|---:|",
        ]
        for r in self.rows:
            ci = "n/a" if math.isnan(r.ci_low) else f"[{r.ci_low:.3f}, {r.ci_high:.3f}]"
            pearson = "n/a" if math.isnan(r.pearson) else f"{r.pearson:.3f}"
            lines.append(f"| {r.estimator} | {r.setting} | {pearson} | {ci} | {r.n_tokens} | {r.n_spans} |")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The analysis
# --------------------------------------------------------------------------------------------------
def correlate_advantages(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts_dataset: Any,
    reward_func: RewardFunc,
    value_fn: ValueFn,
    num_trajectories: int = 64,
    num_spans_per_trajectory: int = 4,
    num_continuations: int = 32,
    temperature: float = 1.0,
    max_new_tokens: int = 512,
    p_grid: Sequence[float] = DEFAULT_P_GRID,
    lam_grid: Sequence[float] = DEFAULT_LAM_GRID,
    sae_lam: float = 0.95,
    seed: int = 0,
    batch_size: int = 32,
    *,
    span_p: float = 0.2,
    adaptive_lambda_alpha: float = 0.2,
    num_bootstrap: int = 1000,
    confidence: float = 0.95,
    reuse_prefix_cache: bool = True,
    show_progress: bool = True,
) -> CorrelationResult:
    """Correlation of GAE / SAE / adaptive-lambda advantages with a Monte-Carlo ``A*`` (paper Section 5.3.2).

    Args:
        policy: causal LM whose advantages are analysed (also the continuation policy).
        tokenizer: its tokenizer; prompts are left padded.
        prompts_dataset: a ``datasets.Dataset`` or list of rows with a ``"prompt"`` column (string or chat
            messages) plus the columns the reward function reads, or a plain list of prompts. Trajectory
            ``j`` uses row ``j % len(rows)``.
        reward_func: TRL-style verifiable reward, ``f(prompts, completions, completion_ids, **columns)
            -> list[float | None]``. ``None`` means "no reward": such trajectories are skipped and such
            continuations leave the Monte-Carlo mean.
        value_fn: ``value_fn(sequences (B, P+T), attention_mask (B, P+T), P) -> (B, T)`` critic values of
            the state before each completion token (see :func:`critic_value_fn`).
        num_trajectories: trajectories sampled.
        num_spans_per_trajectory: spans drawn per trajectory (see :func:`pick_spans`).
        num_continuations: ``K`` Monte-Carlo continuations per span end (32 in the paper).
        temperature: sampling temperature of the trajectories and the continuations.
        max_new_tokens: the rollout horizon; a continuation from ``s_t`` may generate
            ``max_new_tokens - t`` tokens.
        p_grid: SAE thresholds compared.
        lam_grid: GAE lambdas compared.
        sae_lam: SAE's lambda.
        seed: seeds the sampling (torch, restored afterwards), the span draw and the bootstrap.
        batch_size: rows per ``generate`` / critic call.
        span_p: threshold of the probability boundaries that delimit spans.
        adaptive_lambda_alpha: VAPO's alpha for the adaptive-lambda baseline.
        num_bootstrap: bootstrap resamples of spans for the confidence intervals.
        confidence: level of the intervals.
        reuse_prefix_cache: share each span end's prefilled KV cache among its ``K`` continuations.
        show_progress: tqdm bars.

    Returns:
        :class:`CorrelationResult`.
    """
    if num_trajectories < 1 or num_spans_per_trajectory < 1:
        raise ValueError("`num_trajectories` and `num_spans_per_trajectory` must be >= 1.")
    rows = _as_rows(prompts_dataset)
    config = sampling_generation_config(policy, tokenizer, temperature, max_new_tokens)
    device = model_device(policy)
    run_config = {
        "num_trajectories": num_trajectories,
        "num_spans_per_trajectory": num_spans_per_trajectory,
        "num_continuations": num_continuations,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "p_grid": list(p_grid),
        "lam_grid": list(lam_grid),
        "sae_lam": sae_lam,
        "span_p": span_p,
        "adaptive_lambda_alpha": adaptive_lambda_alpha,
        "seed": seed,
        "num_bootstrap": num_bootstrap,
        "confidence": confidence,
        "reuse_prefix_cache": reuse_prefix_cache,
    }

    with _seeded(seed, device), _eval_mode(policy), torch.inference_mode():
        samples = _sample_completions(
            policy, tokenizer, rows, num_trajectories, config, batch_size, show_progress
        )
        # 1. Outcome reward of each trajectory: the reward on its last token and V*(s_L).
        outcome = np.concatenate(
            [
                _score(
                    reward_func,
                    tokenizer,
                    samples.rows[i : i + batch_size],
                    [c.tolist() for c in samples.completion_ids[i : i + batch_size]],
                )
                for i in range(0, num_trajectories, batch_size)
            ]
        )

        # 2. Spans, drawn trajectory by trajectory from one seeded generator.
        rng = np.random.default_rng(seed)
        spans: list[tuple[int, int, int]] = []
        for i, completion in enumerate(samples.completion_ids):
            length = len(completion)
            if length == 0 or math.isnan(outcome[i]):
                continue
            logprobs = samples.logprobs[i].unsqueeze(0)
            boundaries = probability_boundaries(logprobs, torch.ones_like(logprobs), threshold=span_p)[0]
            spans.extend((i, a, b) for a, b in pick_spans(boundaries, length, num_spans_per_trajectory, rng))

        # 3. V* of every distinct span end; s_L is terminal and worth the outcome reward itself.
        state_keys = sorted(
            {(i, t) for i, a, b in spans for t in (a, b) if t < len(samples.completion_ids[i])}
        )
        mc = monte_carlo_values(
            policy,
            tokenizer,
            rows=[samples.rows[i] for i, _ in state_keys],
            prompt_ids=[samples.prompt_ids[i] for i, _ in state_keys],
            prefix_ids=[samples.completion_ids[i][:t].tolist() for i, t in state_keys],
            budgets=[max_new_tokens - t for _, t in state_keys],
            reward_func=reward_func,
            num_continuations=num_continuations,
            temperature=temperature,
            batch_size=batch_size,
            reuse_prefix_cache=reuse_prefix_cache,
            show_progress=show_progress,
        )
        v_star = {key: float(v) for key, v in zip(state_keys, mc.values)}
        for i, completion in enumerate(samples.completion_ids):
            v_star[(i, len(completion))] = float(outcome[i])
        records = [
            SpanRecord(i, a, b, v_star[(i, a)], v_star[(i, b)])
            for i, a, b in spans
            if not (math.isnan(v_star[(i, a)]) or math.isnan(v_star[(i, b)]))
        ]
        if len(records) < len(spans):
            warnings.warn(
                f"{len(spans) - len(records)} spans dropped: every continuation of an end state had a None reward.",
                stacklevel=2,
            )

        # 4. Every estimator's advantages on the trajectories that have spans, batch by batch.
        spans_of: dict[int, list[int]] = {}
        for k, record in enumerate(records):
            spans_of.setdefault(record.trajectory, []).append(k)
        trajectories = sorted(spans_of)
        token_chunks: dict[str, list[np.ndarray]] = {}
        a_star_chunks: list[np.ndarray] = []
        span_id_chunks: list[np.ndarray] = []
        labels: list[tuple[str, str]] = []
        for start in range(0, len(trajectories), batch_size):
            batch = trajectories[start : start + batch_size]
            prompt_ids, prompt_mask = left_pad(
                [samples.prompt_ids[i] for i in batch], config.pad_token_id, device
            )
            completion_ids = right_pad(
                [samples.completion_ids[i] for i in batch], config.pad_token_id, torch.long
            )
            logprobs = right_pad([samples.logprobs[i] for i in batch], 0.0, torch.float32)
            lengths = torch.tensor([len(samples.completion_ids[i]) for i in batch])
            mask = (torch.arange(completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
            sequences = torch.cat([prompt_ids, completion_ids.to(device)], dim=1)
            attention_mask = torch.cat([prompt_mask, mask.to(device)], dim=1)
            values = value_fn(sequences, attention_mask, prompt_ids.shape[1])
            if tuple(values.shape) != tuple(mask.shape):
                raise ValueError(
                    f"`value_fn` returned shape {tuple(values.shape)}; expected (B, T) = {tuple(mask.shape)}."
                )
            values = values.detach().float().cpu()
            rewards = torch.zeros(mask.shape, dtype=torch.float32)
            rewards[torch.arange(len(batch)), lengths - 1] = torch.tensor(
                [outcome[i] for i in batch], dtype=torch.float32
            )
            advantages = estimator_advantages(
                rewards, values, mask, logprobs, lam_grid, p_grid, sae_lam, adaptive_lambda_alpha
            )
            labels = list(advantages)
            for b, i in enumerate(batch):
                for k in spans_of[i]:
                    record = records[k]
                    width = record.end - record.start
                    a_star_chunks.append(np.full(width, record.a_star))
                    span_id_chunks.append(np.full(width, k, dtype=np.int64))
                    for key, adv in advantages.items():
                        token_chunks.setdefault(f"{key[0]}({key[1]})", []).append(
                            adv[b, record.start : record.end].double().numpy()
                        )

    if not records:
        raise RuntimeError("No span could be analysed (no trajectory with a non-None reward and a valid V*).")
    a_star = np.concatenate(a_star_chunks)
    span_ids = np.concatenate(span_id_chunks)
    estimates = {label: np.concatenate(chunks) for label, chunks in token_chunks.items()}

    # 5. Pearson r with A* and a span-level bootstrap (same seed: every estimator sees the same resamples).
    table = []
    for estimator, setting in labels:
        stats = pearson_with_bootstrap(
            estimates[f"{estimator}({setting})"], a_star, span_ids, num_bootstrap, seed, confidence
        )
        table.append(
            CorrelationRow(estimator, setting, *stats, n_tokens=int(a_star.shape[0]), n_spans=len(records))
        )
    return CorrelationResult(
        rows=table,
        a_star=a_star,
        estimates=estimates,
        span_ids=span_ids,
        spans=records,
        trajectory_rewards=outcome,
        config=run_config,
    )
