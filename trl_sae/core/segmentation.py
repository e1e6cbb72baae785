"""Segment boundaries for Segmental Advantage Estimation (pure torch).

Every function returns a bool tensor ``boundaries`` of shape ``(B, T)`` where ``boundaries[i, t]`` is True
when token ``t`` of response ``i`` opens a new segment. Masked (padding) positions are always False.
``boundaries[:, 0]`` never changes an advantage (the first token always opens the first segment), so
segmenters are free to mark it or not.

The tensors follow the index conventions of ``DESIGN.md``: ``mask`` is 1 on the valid tokens of each
response, a contiguous prefix of the row (right padding).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "entropy_boundaries",
    "probability_boundaries",
    "segment_lengths",
    "token_boundaries",
    "uniform_boundaries",
]


def _as_bool_mask(mask: torch.Tensor, like: torch.Tensor | None, name: str = "mask") -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"`{name}` must have shape (B, T); got {tuple(mask.shape)}.")
    if like is not None and like.shape != mask.shape:
        raise ValueError(
            f"`{name}` has shape {tuple(mask.shape)} but the per-token input has shape {tuple(like.shape)}; "
            "pass tensors of the same (B, T) shape."
        )
    return mask.bool()


def probability_boundaries(
    logprobs: torch.Tensor, mask: torch.Tensor, threshold: float = 0.2
) -> torch.Tensor:
    """Probability segmentation, paper Eq. 5: a boundary where the sampled token had probability < p.

    Args:
        logprobs: ``(B, T)`` log-probability the rollout policy assigned to each sampled token.
        mask: ``(B, T)`` 1 on valid tokens (right padded).
        threshold: ``p`` in (0, 1); lower values give fewer, longer segments.

    Returns:
        ``(B, T)`` bool, True where ``exp(logprobs) < threshold`` on valid positions.
    """
    if not 0.0 < float(threshold) < 1.0:
        raise ValueError(f"`threshold` (p) must be in (0, 1), got {threshold}; the paper's default is 0.2.")
    valid = _as_bool_mask(mask, logprobs)
    # Compare in log space: exp(lp) < p  <=>  lp < log p, with no underflow for very unlikely tokens.
    log_threshold = torch.log(torch.tensor(float(threshold), dtype=torch.float64)).item()
    return (logprobs < log_threshold) & valid


def uniform_boundaries(mask: torch.Tensor, segment_length: int = 200) -> torch.Tensor:
    """Uniform segmentation (Theorem 4.1 and the M=200 ablation): a boundary where ``t % M == 0``.

    Args:
        mask: ``(B, T)`` 1 on valid tokens.
        segment_length: ``M``, a positive integer.

    Returns:
        ``(B, T)`` bool.
    """
    if isinstance(segment_length, bool) or int(segment_length) != segment_length or segment_length < 1:
        raise ValueError(f"`segment_length` must be a positive integer, got {segment_length!r}.")
    valid = _as_bool_mask(mask, None)
    positions = torch.arange(valid.shape[1], device=valid.device)
    return (positions % int(segment_length) == 0).unsqueeze(0) & valid


def token_boundaries(
    token_ids: torch.Tensor, mask: torch.Tensor, boundary_token_ids: Iterable[int] | torch.Tensor
) -> torch.Tensor:
    """Token-set segmentation (the newline ablation): a boundary where the token is in a given set.

    Args:
        token_ids: ``(B, T)`` sampled token ids.
        mask: ``(B, T)`` 1 on valid tokens.
        boundary_token_ids: ids that open a segment (e.g. every vocabulary id that contains a newline).

    Returns:
        ``(B, T)`` bool.
    """
    valid = _as_bool_mask(mask, token_ids)
    ids = torch.as_tensor(
        list(boundary_token_ids) if not torch.is_tensor(boundary_token_ids) else boundary_token_ids
    )
    if ids.numel() == 0:
        raise ValueError("`boundary_token_ids` is empty; pass at least one token id that opens a segment.")
    return torch.isin(token_ids, ids.to(token_ids.device, token_ids.dtype)) & valid


def entropy_boundaries(entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """High-entropy segmentation: a boundary where the policy's entropy at ``t`` exceeds a threshold.

    Args:
        entropies: ``(B, T)`` entropy (nats) of the distribution that sampled token ``t``.
        mask: ``(B, T)`` 1 on valid tokens.
        threshold: entropy threshold in nats, ``> 0``.

    Returns:
        ``(B, T)`` bool.
    """
    if not float(threshold) > 0.0:
        raise ValueError(f"`threshold` must be > 0 nats for entropy segmentation, got {threshold}.")
    valid = _as_bool_mask(mask, entropies)
    return (entropies > float(threshold)) & valid


def segment_lengths(boundaries: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response segment statistics.

    The first token always opens a segment, so a response of length ``L`` with ``k`` boundaries at
    positions ``t >= 1`` has ``k + 1`` segments.

    Args:
        boundaries: ``(B, T)`` bool.
        mask: ``(B, T)`` 1 on valid tokens.

    Returns:
        ``(num_boundaries, mean_segment_length)``, both ``(B,)`` float: boundaries at ``t >= 1`` per
        response, and ``L / (num_boundaries + 1)`` (0 for an empty response).
    """
    valid = _as_bool_mask(mask, boundaries)
    num_boundaries = (boundaries[:, 1:] & valid[:, 1:]).sum(dim=1).float()
    lengths = valid.sum(dim=1).float()
    mean_length = torch.where(lengths > 0, lengths / (num_boundaries + 1), torch.zeros_like(lengths))
    return num_boundaries, mean_length
