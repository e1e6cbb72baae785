"""Step metrics, their aggregation over a logging interval, and the completions table.

``SAEPPOTrainer._log_step`` computes one step's metrics with :func:`step_metrics` (gathered over every
process, the exact keys docs/guides/phases.md documents); ``_flush_logs`` logs their means over the steps since the
previous log (:func:`average_logs`) and, with ``log_completions``, the table of one step's completions
with segment boundaries marked (:func:`completion_rows`, :func:`print_completions_table`,
:func:`log_completions_to_wandb`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from trl_sae.core.segmentation import segment_lengths
from trl_sae.trainer.objectives.shaping import boundary_overlap_counts

if TYPE_CHECKING:
    from trl_sae.trainer.rollout_batch import RolloutBatch

__all__ = [
    "LATEST_VALUE_METRICS",
    "average_logs",
    "completion_rows",
    "critic_fit_scores",
    "explained_variance",
    "global_moments",
    "held_out_r2",
    "log_completions_to_wandb",
    "print_completions_table",
    "rlvr_knob_metrics",
    "rollout_mismatch_metrics",
    "step_metrics",
]

# Metrics that are a position, not a per-step measurement: the log shows their latest value.
LATEST_VALUE_METRICS: frozenset[str] = frozenset({"episode", "lr"})

# Loss statistics from the update, averaged over processes.
_UPDATE_KEYS = ("loss/policy", "loss/value", "policy/clipfrac", "policy/approx_kl", "policy/entropy")


def global_moments(accelerator: Accelerator, values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and (population) variance over the valid tokens of every process.

    Args:
        accelerator: sums the per-process counts (a collective: every process must call it).
        values: ``(B, T)``.
        mask: ``(B, T)`` bool.
    """
    values = torch.where(mask, values.float(), torch.zeros((), device=values.device))
    sums = torch.stack([mask.float().sum(), values.sum(), (values**2).sum()])
    count, total, total_sq = accelerator.reduce(sums, reduction="sum").tolist()
    if count == 0:
        return 0.0, 0.0
    mean = total / count
    return mean, total_sq / count - mean**2


def critic_fit_scores(
    accelerator: Accelerator, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float]:
    """``(explained variance, R^2)`` of ``values`` against ``returns`` from one pair of moment collectives;
    see :func:`explained_variance` and :func:`held_out_r2`. Both 0 when the returns barely vary."""
    _, returns_var = global_moments(accelerator, returns, mask)
    residual_mean, residual_var = global_moments(accelerator, returns - values, mask)
    if returns_var <= 1e-8:
        return 0.0, 0.0
    return 1.0 - residual_var / returns_var, 1.0 - (residual_var + residual_mean**2) / returns_var


def explained_variance(
    accelerator: Accelerator, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the valid tokens of every process (a collective), as
    ``critic/explained_variance`` is logged; 0 when the returns barely vary (e.g. every reward 0) rather
    than -1e12."""
    return critic_fit_scores(accelerator, values, returns, mask)[0]


def held_out_r2(
    accelerator: Accelerator, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> float:
    """``1 - E[(returns - values)^2] / Var(returns)`` over the valid tokens of every process (a collective): the
    share of the returns' variance the values explain *as they stand*. Unlike :func:`explained_variance`, a
    constant offset counts against it (values all 0.3 too high explain nothing here, however well they rank
    the states), so it can pick a critic to keep; 0 when the returns barely vary."""
    return critic_fit_scores(accelerator, values, returns, mask)[1]


def step_metrics(
    accelerator: Accelerator,
    batch: RolloutBatch,
    update_stats: Mapping[str, torch.Tensor],
    with_critic: bool = True,
) -> dict[str, float]:
    """One step's rewards, lengths, segments, advantages, critic fit, losses and timings, over every process.

    A collective: every process must call it, with the same ``with_critic``. ``update_stats`` holds the
    update's scalar loss statistics (``loss/policy``, ``policy/clipfrac``, ...; absent keys are left out).
    ``with_critic=False`` (an estimator without a critic, e.g. GRPO) leaves out ``values/mean`` and
    ``critic/explained_variance``: there is no critic whose fit they would measure.
    """
    mask = batch.mask
    scores = accelerator.gather_for_metrics(batch.scores.float())
    lengths = accelerator.gather_for_metrics(batch.lengths.float())
    truncated = accelerator.gather_for_metrics(batch.is_truncated.float().to(lengths.device))
    num_boundaries, mean_segment = segment_lengths(batch.boundaries, mask)
    num_boundaries = accelerator.gather_for_metrics(num_boundaries)
    mean_segment = accelerator.gather_for_metrics(mean_segment)
    metrics: dict[str, float] = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item() if scores.numel() > 1 else 0.0,
    }
    for name, values in batch.reward_per_function.items():
        metrics[f"reward/{name}/mean"] = accelerator.gather_for_metrics(values.float()).mean().item()
    metrics["completions/mean_length"] = lengths.mean().item()
    metrics["completions/clipped_ratio"] = truncated.mean().item()
    metrics["segments/boundaries_per_completion"] = num_boundaries.mean().item()
    metrics["segments/mean_length"] = mean_segment.mean().item()
    adv_mean, adv_var = global_moments(accelerator, batch.raw_advantages, mask)
    metrics["advantages/mean"] = adv_mean
    metrics["advantages/std"] = math.sqrt(max(adv_var, 0.0))
    if with_critic:
        metrics["values/mean"] = global_moments(accelerator, batch.values, mask)[0]
        metrics["critic/explained_variance"] = explained_variance(
            accelerator, batch.values, batch.returns, mask
        )
    for key in _UPDATE_KEYS:
        if key in update_stats:
            metrics[key] = accelerator.reduce(update_stats[key].detach(), reduction="mean").item()
    metrics.update(rollout_mismatch_metrics(accelerator, batch.rollout_stats))
    metrics["timing/rollout_s"] = batch.timings.get("rollout", 0.0)
    metrics["timing/update_s"] = batch.timings.get("update", 0.0)
    return metrics


def rollout_mismatch_metrics(accelerator: Accelerator, stats: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """The vLLM rollout's mismatch with the trainer, over every process (empty without vLLM).

    ``stats`` are :func:`~trl_sae.trainer.setup.vllm.rollout_mismatch_stats`'s sums. Keys:
    ``rollout/logprob_diff_mean`` and ``_max`` (|trainer - vLLM| log-prob of the sampled tokens),
    ``rollout/boundary_flips`` (tokens that are a probability-segmentation boundary under one source but not
    the other, all processes) and ``rollout/boundary_flips_per_completion``, and with the correction
    ``rollout/is_weight_mean`` and ``rollout/is_zero_fraction`` (tokens a ``*_mask`` mode dropped).
    """
    if not stats:
        return {}
    keys = sorted(key for key in stats if key != "abs_diff_max")
    sums = torch.stack([stats[key].double() for key in keys])
    largest = stats["abs_diff_max"].float().reshape(1)
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums, reduction="sum")
        largest = accelerator.gather(largest)
    total = dict(zip(keys, sums.tolist()))
    tokens = max(total["tokens"], 1.0)
    metrics = {
        "rollout/logprob_diff_mean": total["abs_diff_sum"] / tokens,
        "rollout/logprob_diff_max": largest.max().item(),
        "rollout/boundary_flips": total["boundary_flips"],
        "rollout/boundary_flips_per_completion": total["boundary_flips"] / max(total["completions"], 1.0),
    }
    if "is_weight_sum" in total:
        metrics["rollout/is_weight_mean"] = total["is_weight_sum"] / tokens
        metrics["rollout/is_zero_fraction"] = total["is_zero_tokens"] / tokens
    return metrics


def average_logs(
    pending: Mapping[str, Sequence[float]], latest: Iterable[str] = LATEST_VALUE_METRICS
) -> dict[str, float]:
    """Each metric's mean over the steps in ``pending``; the keys in ``latest`` keep their last value."""
    latest = frozenset(latest)
    return {
        key: values[-1] if key in latest else sum(values) / len(values) for key, values in pending.items()
    }


def completion_rows(batch: RolloutBatch, tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """One row per completion of this process: prompt, completion with '|' before each segment boundary
    (except at its first token), reward."""
    rows = []
    for i in range(len(batch.completions)):
        pieces = []
        for t in range(int(batch.lengths[i])):
            token = tokenizer.decode([int(batch.completion_ids[i, t])], skip_special_tokens=True)
            pieces.append(("|" if batch.boundaries[i, t] and t > 0 else "") + token)
        rows.append(
            {
                "prompt": batch.prompts[i] if isinstance(batch.prompts[i], str) else str(batch.prompts[i]),
                "completion_with_boundaries": "".join(pieces),
                "reward": float(batch.scores[i]),
            }
        )
    return rows


def print_completions_table(rows: Sequence[Mapping[str, Any]], step: int, limit: int) -> None:
    """The first ``limit`` rows as a rich table on the console (nothing when rich is not installed)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return
    table = Table(title=f"Completions at step {step} ('|' marks a segment boundary)")
    for column in ("prompt", "completion_with_boundaries", "reward"):
        table.add_column(column)
    for row in rows[:limit]:
        table.add_row(row["prompt"], row["completion_with_boundaries"], f"{row['reward']:.3f}")
    Console().print(table)


def log_completions_to_wandb(rows: Sequence[Mapping[str, Any]], report_to: Sequence[str] | None) -> None:
    """The rows as a wandb table, when ``report_to`` includes wandb and a run is active."""
    if "wandb" in (report_to or []):
        import wandb

        if wandb.run is not None:
            wandb.log(
                {"completions": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}
            )


def rlvr_knob_metrics(
    accelerator: Accelerator, batch: RolloutBatch, update_stats: dict[str, torch.Tensor]
) -> dict[str, float]:
    """The RLVR knobs' metrics, over every process (a collective on every process; a key is absent when its
    knob is off): the two clip fractions, VAPO's positive NLL, the overlong penalty and the task reward
    apart from it, and the high-entropy mask's share of tokens and of segment boundaries."""

    metrics: dict[str, float] = {}
    for key in ("policy/clipfrac_low", "policy/clipfrac_high", "loss/positive_nll"):
        if key in update_stats:
            metrics[key] = accelerator.reduce(update_stats[key].detach(), reduction="mean").item()
    if batch.overlong_penalty is not None:
        # The task reward apart from the shaping, so its curve stays readable.
        penalty = accelerator.gather_for_metrics(batch.overlong_penalty.float())
        scores = accelerator.gather_for_metrics(batch.scores.float())
        metrics["reward/overlong_penalty"] = penalty.mean().item()
        metrics["reward/task_mean"] = (scores - penalty).mean().item()
    if "high_entropy" in batch.loss_masks:
        policy, high = batch.loss_masks["policy"], batch.loss_masks["high_entropy"]
        sums = torch.cat(
            [
                torch.stack([high.sum(), policy.sum()]).float(),
                boundary_overlap_counts(batch.boundaries, high, policy),
            ]
        )
        kept, eligible, inside, boundaries = accelerator.reduce(sums, reduction="sum").tolist()
        metrics["policy/entropy_mask_fraction"] = kept / eligible if eligible else 0.0
        metrics["policy/boundaries_in_entropy_mask"] = inside / boundaries if boundaries else 0.0
    return metrics
