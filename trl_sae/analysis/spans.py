"""Span picking for the ``A*`` analysis: the segment anchors of a response and the spans drawn between them.

Index conventions follow docs/design.md: ``s_t`` is the state before completion token ``t``, ``s_L`` the
terminal state after the last valid token.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import torch

__all__ = ["pick_spans", "segment_anchors"]


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
