"""Dynamic sampling (DAPO's group filter): which prompt groups a step trains on and how its batch is built.

A *group* is the ``num_generations`` completions of one prompt (consecutive rows of a rollout batch). A
group whose final scores (``RolloutBatch.scores`` as ``Rollouts.score`` leaves them, every shaping applied)
all agree is *uninformative*: a group estimator (GRPO, RLOO-like) gives every completion the advantage 0, so
it carries no policy gradient and only dilutes the loss. With ``filter_groups`` the trainer drops such groups
and samples further prompt batches, up to ``max_num_gen_batches`` generation rounds per step, until the
processes together have the batch's number of informative groups (names and round semantics as verl's
``algorithm.filter_groups.enable`` / ``max_num_gen_batches``, metric ``num_gen_batches``).

"All agree" is decided by the range: ``max - min <= AGREEMENT_TOLERANCE`` over the group. The range of
equal floats is exactly 0 (a std subtracts a rounded mean and needs a tolerance anyway), and the tolerance
only absorbs float32 rounding of the same reward summed in another order; a real difference in reward (a
length penalty of 1e-3, say) keeps the group.

With several processes the batch is filtered as a whole, as verl's (its ``num_prompt_in_batch`` is global):
the rounds stop once all processes together hold the global batch's number of informative groups, and
processes with more than their share send the rest to the processes with fewer (:func:`plan_transfers`, one
all-gather of the rows moved). A process short of informative groups no longer makes every process sample
another round while another holds a surplus.

Assembly (:func:`select_groups`): the first informative groups in round order fill the batch; informative
groups beyond it (verl trims the same way) are discarded, their prompts counted as used. When the round bound
is reached with too few, the batch is padded with agreeing groups in round order, so it always has
``local_prompts_per_step`` groups: every later phase keeps its shapes and mini-batch splits, and the step
degrades to the unfiltered one rather than shrinking (or leaving a process with no rows).

The prompt stream: round ``r`` of a step draws the trainer's prompt batch number ``position + r``
(``Rollouts.prompt_indices``), ``position`` being the number of prompt batches drawn by the steps before.
Without the filter that number is the step; with it, it is kept in the trainer state
(:func:`record_prompt_stream`), saved with every checkpoint and restored on resume
(:func:`restore_prompt_stream`), so a resumed run draws exactly the prompts the uninterrupted one would.

Pure torch; ``Rollouts.collect`` (:mod:`trl_sae.trainer.parts.rollout`) runs the rounds and agrees on their number
across processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "AGREEMENT_TOLERANCE",
    "PROMPT_STREAM_KEY",
    "GroupSelection",
    "batch_to",
    "informative_groups",
    "plan_transfers",
    "prompt_stream_position",
    "record_prompt_stream",
    "restore_prompt_stream",
    "sampling_metrics",
    "select_groups",
    "take_groups",
]

AGREEMENT_TOLERANCE = 1e-6

# The entry of TrainerState.stateful_callbacks (saved in trainer_state.json) that holds the stream position.
PROMPT_STREAM_KEY = "DynamicSamplingPromptStream"

Batch = TypeVar("Batch")


def informative_groups(
    scores: torch.Tensor, num_generations: int, tolerance: float = AGREEMENT_TOLERANCE
) -> torch.Tensor:
    """Which groups' scores do not all agree.

    Args:
        scores: ``(B,)`` final score of each completion, groups of ``num_generations`` consecutive rows.
        num_generations: completions per prompt, >= 2.
        tolerance: a group agrees when ``max - min <= tolerance``.

    Returns:
        ``(B // num_generations,)`` bool, True for a group worth training on.
    """
    if scores.dim() != 1 or scores.numel() % num_generations:
        raise ValueError(
            f"scores must be (B,) with B a multiple of {num_generations}, got {tuple(scores.shape)}."
        )
    groups = scores.reshape(-1, num_generations)
    return (groups.amax(dim=1) - groups.amin(dim=1)) > tolerance


@dataclass(frozen=True)
class GroupSelection:
    """The groups of one step's batch on one process, and what became of the others.

    ``picks`` are ``(round, group)`` pairs in batch order (by round, then group). Counts are groups:
    ``informative + padded == len(picks)``; ``informative + padded + dropped + surplus`` is every group
    generated.
    """

    picks: list[tuple[int, int]]
    informative: int  # informative groups in the batch
    padded: int  # agreeing groups in the batch (the round bound was reached)
    dropped: int  # agreeing groups left out
    surplus: int  # informative groups left out (the batch was full)
    spare: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # those, in round order

    def counts(self) -> torch.Tensor:
        """``(4,)`` float64: informative, padded, dropped, surplus (what :func:`sampling_metrics` reads)."""
        return torch.tensor([self.informative, self.padded, self.dropped, self.surplus], dtype=torch.float64)


def select_groups(
    informative_per_round: Sequence[torch.Tensor], groups_needed: int, received: int = 0
) -> GroupSelection:
    """The first ``groups_needed - received`` informative groups in round order; if there are fewer, the batch
    is completed with agreeing groups, also in round order.

    Args:
        informative_per_round: one ``(G_r,)`` bool tensor per generation round (:func:`informative_groups`).
        groups_needed: groups in the batch; at most the number generated.
        received: informative groups other processes send to this one (:func:`plan_transfers`), which take
            the place of as many of its own picks (of padding: a process receives only while it is short).
    """
    flags = [(r, g, bool(flag)) for r, row in enumerate(informative_per_round) for g, flag in enumerate(row)]
    if groups_needed > len(flags):
        raise ValueError(f"need {groups_needed} groups but only {len(flags)} were generated.")
    if not 0 <= received <= groups_needed:
        raise ValueError(f"received must be in [0, {groups_needed}], got {received}.")
    own = groups_needed - received
    good = [(r, g) for r, g, flag in flags if flag]
    agreeing = [(r, g) for r, g, flag in flags if not flag]
    informative = good[:own]
    padding = agreeing[: own - len(informative)]
    return GroupSelection(
        picks=sorted(informative + padding),
        informative=len(informative) + received,
        padded=len(padding),
        dropped=len(agreeing) - len(padding),
        surplus=len(good) - len(informative),
        spare=good[own:],
    )


def plan_transfers(informative_counts: Sequence[int], groups_needed: int) -> list[tuple[int, int, int]]:
    """Which process sends how many informative groups to which, so that as many processes as possible
    train on ``groups_needed`` informative groups (the whole batch is then filtered as one, as verl's is).

    A process keeps up to ``groups_needed`` of its own; processes with more offer the rest, in process
    order, to the processes with fewer, in process order, until the offers or the shortfalls run out.
    Every process computes the same plan from the same gathered counts.

    Args:
        informative_counts: informative groups each process generated this step.
        groups_needed: groups per process in the step's batch (``local_prompts_per_step``).

    Returns:
        ``(source, destination, number of groups)`` triples, in source order then destination order.
    """
    offers = [
        [rank, count - groups_needed]
        for rank, count in enumerate(informative_counts)
        if count > groups_needed
    ]
    transfers: list[tuple[int, int, int]] = []
    for rank, count in enumerate(informative_counts):
        short = groups_needed - count
        while short > 0 and offers:
            source = offers[0]
            moved = min(short, source[1])
            transfers.append((source[0], rank, moved))
            short -= moved
            source[1] -= moved
            if source[1] == 0:
                offers.pop(0)
    return sorted(transfers)


def sampling_metrics(counts: torch.Tensor, generation_rounds: int) -> dict[str, float]:
    """The step's ``dynamic_sampling/*`` metrics.

    Args:
        counts: ``(4,)`` :class:`GroupSelection`'s ``informative, padded, dropped, surplus``, summed over
            processes.
        generation_rounds: rounds the step ran (the same on every process).
    """
    informative, padded, dropped, surplus = counts.tolist()
    in_batch = informative + padded
    return {
        "dynamic_sampling/generation_rounds": float(generation_rounds),
        "dynamic_sampling/groups_generated": informative + padded + dropped + surplus,
        "dynamic_sampling/groups_dropped": dropped,
        "dynamic_sampling/groups_padded": padded,
        "dynamic_sampling/groups_surplus": surplus,
        "dynamic_sampling/kept_fraction": informative / in_batch if in_batch else 0.0,
    }


def take_groups(
    batches: Sequence[Batch], picks: Sequence[tuple[int, int]], num_generations: int, pad_token_id: int
) -> Batch:
    """One rollout batch made of the picked groups of several rounds' batches.

    Every per-row field is taken row-wise: ``(B, P)`` prompt tensors (``prompt_*``) are left-padded to the
    widest round, other ``(B, T)`` tensors right-padded (``completion_ids`` with ``pad_token_id``, the rest
    with 0), ``(B,)`` tensors, lists and dicts of either concatenated. ``timings`` and ``rollout_stats``
    (per-batch, not per-row) are left empty for the caller to fill.

    Args:
        batches: the rounds' ``RolloutBatch`` (rolled out and scored), ``B_r`` rows each.
        picks: ``(round, group)`` pairs, as :attr:`GroupSelection.picks`.
        num_generations: rows per group.
        pad_token_id: fill of ``prompt_ids`` and ``completion_ids``.
    """
    rows: list[tuple[int, torch.Tensor]] = []
    for round_index in sorted({r for r, _ in picks}):
        groups = torch.tensor([g for r, g in picks if r == round_index], dtype=torch.long)
        index = (groups[:, None] * num_generations + torch.arange(num_generations)).reshape(-1)
        rows.append((round_index, index))
    values = {}
    for f in dataclasses.fields(batches[0]):
        if f.name in ("timings", "rollout_stats"):
            values[f.name] = {}
            continue
        parts = [getattr(batches[r], f.name) for r, _ in rows]
        values[f.name] = _concatenate(f.name, parts, [index for _, index in rows], pad_token_id)
    return type(batches[0])(**values)


def batch_to(batch: Batch, device: torch.device | str) -> Batch:
    """A copy of a rollout batch with every tensor (those in dict fields too) on ``device``: groups sent to
    another process travel on the CPU (a pickled CUDA tensor would land on the sender's GPU index)."""

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, dict):
            return {key: move(item) for key, item in value.items()}
        return value

    return dataclasses.replace(
        batch, **{f.name: move(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    )


def _concatenate(name: str, parts: list[Any], indices: list[torch.Tensor], pad_token_id: int) -> Any:
    first = parts[0]
    if first is None:
        if any(part is not None for part in parts):
            raise ValueError(f"RolloutBatch.{name} is set in some rounds only.")
        return None
    if isinstance(first, dict):
        return {
            key: _concatenate(f"{name}.{key}", [p[key] for p in parts], indices, pad_token_id)
            for key in first
        }
    if isinstance(first, list):
        return [part[i] for part, index in zip(parts, indices) for i in index.tolist()]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"RolloutBatch.{name}: cannot take rows of a {type(first).__name__}.")
    taken = [part[index.to(part.device)] for part, index in zip(parts, indices)]
    if first.dim() == 1:
        return torch.cat(taken)
    width = max(part.shape[1] for part in taken)
    fill = pad_token_id if name in ("prompt_ids", "completion_ids") else 0
    left = name.startswith("prompt_")  # prompts are left-padded, completions right-padded
    padded = [
        nn.functional.pad(
            part, (width - part.shape[1], 0) if left else (0, width - part.shape[1]), value=fill
        )
        for part in taken
    ]
    return torch.cat(padded)


def prompt_stream_position(state: Any) -> int:
    """Prompt batches drawn by the steps before ``state.global_step``: the recorded number when it was
    recorded for this step, else the step (a run that never filtered draws one batch per step)."""
    entry = state.stateful_callbacks.get(PROMPT_STREAM_KEY)
    if entry is not None and entry["attributes"]["global_step"] == state.global_step:
        return int(entry["attributes"]["prompt_batches_drawn"])
    return int(state.global_step)


def record_prompt_stream(state: Any, global_step: int, prompt_batches_drawn: int) -> None:
    """Record that the step at ``global_step`` starts at prompt batch ``prompt_batches_drawn``; saved with the
    trainer state (in the ``ExportableState`` layout of ``stateful_callbacks``)."""
    state.stateful_callbacks[PROMPT_STREAM_KEY] = {
        "args": {},
        "attributes": {"global_step": int(global_step), "prompt_batches_drawn": int(prompt_batches_drawn)},
    }


def restore_prompt_stream(state: Any, saved_state: Any) -> None:
    """Copy a checkpoint's stream position (if it recorded one) into the resumed run's ``state``."""
    entry = (saved_state.stateful_callbacks or {}).get(PROMPT_STREAM_KEY)
    if entry is not None:
        state.stateful_callbacks[PROMPT_STREAM_KEY] = entry
