"""Segment boundaries for Segmental Advantage Estimation (pure torch).

Every function returns a bool tensor ``boundaries`` of shape ``(B, T)`` where ``boundaries[i, t]`` is True
when token ``t`` of response ``i`` opens a new segment. Masked (padding) positions are always False.
``boundaries[:, 0]`` never changes an advantage (the first token always opens the first segment), so
segmenters are free to mark it or not.

The tensors follow the index conventions of ``docs/design.md``: ``mask`` is 1 on the valid tokens of each
response, a contiguous prefix of the row (right padding).

The trainer picks a segmenter by name from :data:`SEGMENTERS` (``SAEPPOConfig.segmentation``); add your own
with :func:`register_segmenter`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from trl_sae.core._registry import declared_inputs

__all__ = [
    "SEGMENTERS",
    "SEGMENTER_INPUTS",
    "SegmenterSpec",
    "entropy_boundaries",
    "get_segmenter",
    "get_segmenter_spec",
    "probability_boundaries",
    "register_segmenter",
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


# --------------------------------------------------------------------------------------------------
# Registry: one keyword signature for every segmenter, so the trainer switches by name.
# --------------------------------------------------------------------------------------------------
Segmenter = Callable[..., torch.Tensor]

#: The keyword arguments every registered segmenter is called with (it ignores those it does not use).
SEGMENTER_INPUTS: tuple[str, ...] = (
    "logprobs",
    "entropies",
    "token_ids",
    "mask",
    "newline_token_ids",
    "segment_threshold",
    "segment_length",
    "entropy_threshold",
)


@dataclass(frozen=True)
class SegmenterSpec:
    """A registered segmenter. Calling the spec calls ``fn`` and checks what it returns.

    Attributes:
        name: the registry key, the value of ``SAEPPOConfig.segmentation``.
        fn: the segmenter, called with the keyword arguments :data:`SEGMENTER_INPUTS`.
        reads: the inputs it names as keyword parameters (from its signature). Inputs that cost something
            to build (``newline_token_ids`` scans the vocabulary) are only built for segmenters that read
            them, and the model card lists only the settings it reads.
    """

    name: str
    fn: Segmenter
    reads: frozenset[str] = frozenset()

    def __call__(self, *, mask: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """``(B, T)`` bool boundaries, False on masked positions (whatever ``fn`` put there)."""
        boundaries = self.fn(mask=mask, **inputs)
        if not torch.is_tensor(boundaries) or boundaries.shape != mask.shape:
            got = tuple(boundaries.shape) if torch.is_tensor(boundaries) else type(boundaries).__name__
            raise ValueError(
                f"The segmenter {self.name!r} returned {got}; it must return a (B, T) bool tensor shaped like "
                f"`mask` {tuple(mask.shape)}."
            )
        return boundaries.bool() & mask.bool()


SEGMENTERS: dict[str, SegmenterSpec] = {}


def register_segmenter(name: str, fn: Segmenter | None = None) -> Any:
    """Add a segmenter to :data:`SEGMENTERS` under ``name`` (the value of ``SAEPPOConfig.segmentation``).

    Use as ``register_segmenter("name", fn)`` or as a decorator, ``@register_segmenter("name")``; both return
    ``fn`` unchanged. Register before building the ``SAEPPOConfig`` that names it.

    A segmenter is a pure-torch function called with keyword arguments only, every one of
    :data:`SEGMENTER_INPUTS`; it names the ones it reads as keyword parameters and takes ``**kwargs`` for
    the rest:

    * ``logprobs``: ``(B, T)`` float, log-probability the rollout policy gave each sampled token;
    * ``entropies``: ``(B, T)`` float, entropy (nats) of the distribution each token was sampled from;
    * ``token_ids``: ``(B, T)`` long, the sampled completion tokens (padding holds the pad id);
    * ``mask``: ``(B, T)`` bool, True on valid tokens, a contiguous prefix of each row;
    * ``newline_token_ids``: ``(K,)`` long, every vocabulary id whose text contains a newline (computed by
      the trainer from its tokenizer, only for segmenters that name this input; None for the others);
    * ``segment_threshold``, ``segment_length``, ``entropy_threshold``: the ``SAEPPOConfig`` settings of the
      same names.

    It returns ``(B, T)`` bool boundaries, True where token ``t`` opens a segment; positions outside
    ``mask`` are cleared, and ``boundaries[:, 0]`` never changes an advantage. Other settings are bound with
    ``functools.partial`` or a closure.

    Raises:
        ValueError: ``name`` is already registered.
        TypeError: ``fn`` takes no ``**kwargs`` or requires an argument it is never given.
    """

    def register(fn: Segmenter) -> Segmenter:
        if not isinstance(name, str) or not name:
            raise ValueError(f"A segmenter's name must be a non-empty string, got {name!r}.")
        if name in SEGMENTERS:
            raise ValueError(
                f"A segmenter named {name!r} is already registered; pick another name "
                f"(registered: {sorted(SEGMENTERS)})."
            )
        reads = declared_inputs("segmenter", name, fn, SEGMENTER_INPUTS)
        SEGMENTERS[name] = SegmenterSpec(name=name, fn=fn, reads=reads)
        return fn

    return register if fn is None else register(fn)


def get_segmenter_spec(name: str) -> SegmenterSpec:
    """The registered :class:`SegmenterSpec` called ``name``; a ``ValueError`` listing the names if none is."""
    try:
        return SEGMENTERS[name]
    except KeyError:
        raise ValueError(
            f"Unknown segmenter {name!r}; valid names: {sorted(SEGMENTERS)} (register your own with "
            "trl_sae.register_segmenter)."
        ) from None


def get_segmenter(name: str) -> Segmenter:
    """Look a segmenter function up by name (``"probability"``, ``"uniform"``, ``"newline"``, ``"entropy"``
    or a registered one)."""
    return get_segmenter_spec(name).fn


@register_segmenter("probability")
def _probability_segmenter(*, logprobs, mask, segment_threshold, **_):
    return probability_boundaries(logprobs, mask, segment_threshold)


@register_segmenter("uniform")
def _uniform_segmenter(*, mask, segment_length, **_):
    return uniform_boundaries(mask, segment_length)


@register_segmenter("newline")
def _newline_segmenter(*, token_ids, mask, newline_token_ids, **_):
    if newline_token_ids is None:
        raise ValueError(
            "The 'newline' segmenter needs `newline_token_ids` (the vocabulary ids containing a newline)."
        )
    return token_boundaries(token_ids, mask, newline_token_ids)


@register_segmenter("entropy")
def _entropy_segmenter(*, entropies, mask, entropy_threshold, **_):
    return entropy_boundaries(entropies, mask, entropy_threshold)
