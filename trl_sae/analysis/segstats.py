"""Segment statistics as a function of the probability threshold ``p`` (the paper's appendix figure
"Average Segmentation Length for Different Segmentation Threshold p").

One set of completions is sampled and their log-probabilities are kept; every ``p`` of the grid then
only moves the boundaries (``exp(logprob[t]) < p``, paper Eq. 5). Reusing one sample means differences
between rows come from the threshold alone, not from sampling noise, and the boundary counts are
monotone in ``p`` by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trl_sae.analysis.sampling import (
    as_rows,
    eval_mode,
    sample_completions,
    sampling_generation_config,
    seeded,
)
from trl_sae.core.segmentation import probability_boundaries, segment_lengths
from trl_sae.generation.inputs import model_device, right_pad

__all__ = [
    "DEFAULT_SEGSTATS_P_GRID",
    "SegmentStatsRow",
    "segment_stats_from_logprobs",
    "segment_stats_vs_threshold",
]

DEFAULT_SEGSTATS_P_GRID: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)


@dataclass
class SegmentStatsRow:
    """Segment statistics at one threshold ``p``.

    Attributes:
        p: the probability threshold.
        mean_segment_length: tokens per segment, pooled over completions (total valid tokens / total
            segments; a completion with ``k`` boundaries at ``t >= 1`` has ``k + 1`` segments).
        boundaries_per_completion: mean number of boundaries at ``t >= 1`` per completion.
        mean_completion_length: mean number of valid tokens per completion (the same for every ``p``).
        num_completions: completions the row is computed from.
    """

    p: float
    mean_segment_length: float
    boundaries_per_completion: float
    mean_completion_length: float
    num_completions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def segment_stats_from_logprobs(
    logprobs: torch.Tensor, mask: torch.Tensor, p_grid: Sequence[float] = DEFAULT_SEGSTATS_P_GRID
) -> list[SegmentStatsRow]:
    """Segment statistics for each ``p`` from one batch of rollout log-probabilities.

    Args:
        logprobs: ``(B, T)`` log-probability the rollout policy gave each sampled token.
        mask: ``(B, T)`` 1 on valid tokens (right padding).
        p_grid: thresholds, each in (0, 1).

    Returns:
        One :class:`SegmentStatsRow` per ``p``, in the order of ``p_grid``.
    """
    if logprobs.dim() != 2 or logprobs.shape != mask.shape:
        raise ValueError(
            f"`logprobs` and `mask` must share one (B, T) shape; got {tuple(logprobs.shape)} and "
            f"{tuple(mask.shape)}."
        )
    lengths = mask.bool().sum(dim=1).float()
    num_completions = int(logprobs.shape[0])
    total_tokens = float(lengths.sum())
    rows = []
    for p in p_grid:
        boundaries = probability_boundaries(logprobs, mask, threshold=float(p))
        num_boundaries, _ = segment_lengths(boundaries, mask)
        # Empty completions have no segment at all; every other one has its boundaries + 1.
        total_segments = float((num_boundaries + 1)[lengths > 0].sum())
        rows.append(
            SegmentStatsRow(
                p=float(p),
                mean_segment_length=total_tokens / total_segments if total_segments else 0.0,
                boundaries_per_completion=float(num_boundaries.mean()) if num_completions else 0.0,
                mean_completion_length=float(lengths.mean()) if num_completions else 0.0,
                num_completions=num_completions,
            )
        )
    return rows


def segment_stats_vs_threshold(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Any,
    p_grid: Sequence[float] = DEFAULT_SEGSTATS_P_GRID,
    num_samples: int = 64,
    temperature: float = 1.0,
    max_new_tokens: int = 512,
    seed: int = 0,
    batch_size: int = 32,
    show_progress: bool = True,
) -> list[SegmentStatsRow]:
    """Sample completions once and tabulate segment statistics for every ``p`` of the grid.

    Args:
        policy: causal LM.
        tokenizer: its tokenizer (prompts are left padded; chat prompts go through its chat template).
        prompts: a ``datasets.Dataset`` / list of rows with a ``"prompt"`` column, or a list of prompts
            (strings or chat messages); sample ``j`` uses prompt ``j % len(prompts)``.
        p_grid: thresholds, each in (0, 1).
        num_samples: completions sampled.
        temperature: sampling temperature (the boundaries use the tempered log-probabilities, as in PPO).
        max_new_tokens: generation budget.
        seed: seeds the sampling (the caller's torch RNG state is restored afterwards).
        batch_size: prompts per ``generate`` call.
        show_progress: a tqdm bar.

    Returns:
        One :class:`SegmentStatsRow` per ``p``.
    """
    if num_samples < 1:
        raise ValueError(f"`num_samples` must be >= 1, got {num_samples}.")
    rows = as_rows(prompts)
    config = sampling_generation_config(policy, tokenizer, temperature, max_new_tokens)
    with seeded(seed, model_device(policy)), eval_mode(policy), torch.inference_mode():
        samples = sample_completions(
            policy, tokenizer, rows, num_samples, config, batch_size, show_progress, desc="completions"
        )
    logprobs = right_pad(samples.logprobs, 0.0, torch.float32)
    lengths = torch.tensor([len(c) for c in samples.completion_ids])
    mask = (torch.arange(logprobs.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return segment_stats_from_logprobs(logprobs, mask, p_grid)
