"""The RLVR knobs outside the loss terms: DAPO's overlong reward shaping and the "80/20" high-entropy token
mask, as plain tensor functions (``Rollouts.score`` and ``PPOUpdate`` call them).

Shapes: ``B`` completions, ``T`` completion tokens; ``mask`` is ``(B, T)`` bool, True on valid tokens, EOS
included (index conventions in docs/design.md). Pure torch: no TRL or transformers import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["boundary_overlap_counts", "high_entropy_mask", "linear_quantile", "overlong_penalty"]


def overlong_penalty(
    lengths: torch.Tensor, response_length: int, buffer_length: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (DAPO Eq. 13), added to the outcome reward.

    Follows verl's DAPO reward manager (``overlong_buffer.len`` / ``.penalty_factor``) and equals
    ``penalty_factor`` times TRL's ``trl.rewards.get_soft_overlong_punishment``: with ``M = response_length``
    and ``B = buffer_length``, a completion of ``L`` tokens (EOS included) gets

        penalty = min(0, -(L - (M - B)) / B * penalty_factor)

    i.e. 0 up to ``M - B`` tokens, then falling linearly to ``-penalty_factor`` at ``L = M``.

    Args:
        lengths: ``(B,)`` valid completion tokens per row.
        response_length: ``M``, the most tokens a completion may have.
        buffer_length: ``B`` in ``[1, M)``: the last tokens before ``M`` where the penalty grows.
        penalty_factor: the penalty at ``L = M`` (>= 0).

    Returns:
        ``(B,)`` float penalties, all <= 0.
    """
    expected = response_length - buffer_length
    excess = lengths.float() - expected
    return (-excess / buffer_length * penalty_factor).clamp(max=0.0)


def linear_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-quantile of a 1-D tensor with linear interpolation, as ``torch.quantile`` (its default).

    Written with a sort because ``torch.quantile`` refuses inputs of more than 2^24 elements, fewer than
    the valid tokens of one large RLVR batch.

    Args:
        values: ``(N,)``, ``N >= 1``.
        q: in ``[0, 1]``.

    Returns:
        A scalar tensor.
    """
    ordered = values.sort().values
    position = q * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def high_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    quantile: float,
    gather_valid: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The tokens in the top ``quantile`` of entropy ("Beyond the 80/20 Rule", arXiv:2506.01939; TRL's
    ``top_entropy_quantile``): those whose entropy is at least the ``1 - quantile`` quantile of every valid
    token's entropy, as TRL's ``GRPOTrainer.get_high_entropy_mask``.

    TRL computes the threshold per micro-batch from the update's forward; here it is taken once per step over
    the whole batch (``gather_valid``: every process's valid tokens), so the mask does not depend on how the
    batch is split, and from the rollout's entropies, the same per-token statistic SAE's segmenters read.
    ``quantile = 1`` keeps every valid token.

    Args:
        entropies: ``(B, T)`` entropy of each sampled position (nats).
        mask: ``(B, T)`` bool, the tokens eligible (valid, and not truncated when those are dropped).
        quantile: ``rho`` in ``(0, 1]``.
        gather_valid: maps this process's ``(N,)`` eligible entropies to every process's ``(N_total,)``;
            None: this process's only.

    Returns:
        ``(B, T)`` bool, False outside ``mask``.
    """
    mask = mask.bool()
    valid = entropies[mask].float()
    if gather_valid is not None:
        valid = gather_valid(valid)
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = linear_quantile(valid, 1.0 - quantile)
    return (entropies.float() >= threshold) & mask


def boundary_overlap_counts(
    boundaries: torch.Tensor, token_mask: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """How many SAE boundaries fall inside a token mask: ``(boundaries inside token_mask, boundaries)``.

    Boundaries are counted at ``t >= 1`` on valid tokens, as ``segment_lengths`` counts them
    (``boundaries[0]`` never matters). Sums, so that they add over processes before dividing.

    Args:
        boundaries: ``(B, T)`` bool.
        token_mask: ``(B, T)`` bool, e.g. :func:`high_entropy_mask`'s.
        mask: ``(B, T)`` bool, the valid tokens.

    Returns:
        ``(2,)`` float.
    """
    counted = boundaries.bool()[:, 1:] & mask.bool()[:, 1:]
    inside = counted & token_mask.bool()[:, 1:]
    return torch.stack([inside.sum(), counted.sum()]).float()
