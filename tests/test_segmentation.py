"""Tests of the segmenters against their definitions (paper Eq. 5 and the ablations' variants).

Every segmenter returns ``boundaries[i, t]`` True when token ``t`` opens a segment, and False on padding.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.core.advantages import sae_advantages
from trl_sae.core.segmentation import (
    entropy_boundaries,
    probability_boundaries,
    segment_lengths,
    token_boundaries,
    uniform_boundaries,
)

FAST = settings(max_examples=60, deadline=None)


def prefix_mask(lengths: list[int], length_max: int) -> torch.Tensor:
    return (torch.arange(length_max).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()


# --------------------------------------------------------------------------------------------------
# Probability segmentation (paper Eq. 5): boundary iff P(s_t | s_<t) < p
# --------------------------------------------------------------------------------------------------
def test_probability_boundaries_definition() -> None:
    # Probabilities well away from p = 0.2, so the check does not hinge on rounding at the threshold.
    probs = torch.tensor([[0.9, 0.05, 0.3, 0.19, 0.21, 1.0], [0.01, 0.5, 0.1, 0.99, 0.0001, 0.15]])
    mask = prefix_mask([6, 4], 6)
    got = probability_boundaries(probs.log(), mask)  # default threshold 0.2
    expected = torch.tensor(
        [[False, True, False, True, False, False], [True, False, True, False, False, False]]
    )  # row 1: positions 4 and 5 are padding although their probabilities are below p
    assert got.dtype == torch.bool
    assert torch.equal(got, expected)
    # A higher p marks more tokens.
    assert torch.equal(probability_boundaries(probs.log(), mask, threshold=0.5)[0], probs[0] < 0.5)


def test_probability_boundaries_extreme_logprobs() -> None:
    # Tokens so unlikely that exp(logprob) underflows to 0 are boundaries; NaN padding is not.
    logprobs = torch.tensor([[-1e4, -float("inf"), 0.0, -200.0, float("nan"), float("nan")]])
    mask = prefix_mask([4], 6)
    assert probability_boundaries(logprobs, mask).tolist() == [[True, True, False, True, False, False]]
    # bf16 log-probabilities work without a cast by the caller.
    bf16 = probability_boundaries(torch.tensor([[-3.0, -0.1]], dtype=torch.bfloat16), torch.ones(1, 2))
    assert bf16.tolist() == [[True, False]]


@FAST
@given(
    probs=st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=30),
    threshold=st.floats(0.01, 0.99),
    length_frac=st.floats(0.0, 1.0),
)
def test_property_probability_boundaries(probs: list[float], threshold: float, length_frac: float) -> None:
    # Keep the probabilities off a float32 rounding band around p; the definition is a strict "<".
    probs = [p for p in probs if abs(p - threshold) > 1e-4 * threshold] or [1.0]
    length = round(length_frac * len(probs))
    logprobs = torch.tensor([[math.log(p) for p in probs]])
    mask = prefix_mask([length], len(probs))
    got = probability_boundaries(logprobs, mask, threshold=threshold)[0].tolist()
    expected = [t < length and p < threshold for t, p in enumerate(probs)]
    assert got == expected


@pytest.mark.parametrize("threshold", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_probability_threshold_validation(threshold: float) -> None:
    with pytest.raises(ValueError, match="`threshold`"):
        probability_boundaries(torch.zeros(1, 3), torch.ones(1, 3), threshold=threshold)


def test_probability_shape_mismatch_names_mask() -> None:
    with pytest.raises(ValueError, match="`mask`"):
        probability_boundaries(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="`mask`"):
        probability_boundaries(torch.zeros(3), torch.ones(3))


# --------------------------------------------------------------------------------------------------
# Uniform segmentation (Theorem 4.1): boundary iff t % M == 0
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("segment_length", [1, 2, 3, 7, 200])
def test_uniform_boundaries_definition(segment_length: int) -> None:
    lengths = [0, 1, 10, 25]
    mask = prefix_mask(lengths, 25)
    got = uniform_boundaries(mask, segment_length=segment_length)
    for i, length in enumerate(lengths):
        expected = [t < length and t % segment_length == 0 for t in range(25)]
        assert got[i].tolist() == expected
    if segment_length == 1:
        assert torch.equal(got, mask.bool())  # every token its own segment: GAE


def test_uniform_default_is_200() -> None:
    mask = torch.ones(1, 450)
    assert torch.nonzero(uniform_boundaries(mask)[0]).flatten().tolist() == [0, 200, 400]


@pytest.mark.parametrize("segment_length", [0, -3, 2.5, True, "4"])
def test_uniform_segment_length_validation(segment_length: object) -> None:
    with pytest.raises(ValueError, match="`segment_length`"):
        uniform_boundaries(torch.ones(1, 5), segment_length=segment_length)  # type: ignore[arg-type]


def test_uniform_mask_must_be_two_dimensional() -> None:
    with pytest.raises(ValueError, match="`mask`"):
        uniform_boundaries(torch.ones(5), segment_length=2)


def test_uniform_segments_make_sae_decay_once_per_segment() -> None:
    # With zero values and a unit reward on each token, A_0 = sum_t lam^(floor(t / M)) (Theorem 4.1's
    # product), so the count of decays is visible in the number.
    length, segment, lam = 12, 4, 0.5
    mask = torch.ones(1, length)
    rewards = torch.ones(1, length, dtype=torch.float64)
    advantages, _ = sae_advantages(
        rewards, torch.zeros_like(rewards), mask, uniform_boundaries(mask, segment), lam=lam
    )
    assert advantages[0, 0].item() == pytest.approx(4 * (1 + 0.5 + 0.25))


# --------------------------------------------------------------------------------------------------
# Token-set segmentation (newline ablation)
# --------------------------------------------------------------------------------------------------
def test_token_boundaries_definition() -> None:
    newline_ids = {10, 13}
    pad_id = 10  # a padding id that is itself in the set must still not mark padding
    token_ids = torch.tensor([[5, 10, 7, 13, 10, 10], [13, 1, 2, pad_id, pad_id, pad_id]])
    mask = prefix_mask([6, 3], 6)
    expected = [[False, True, False, True, True, True], [True, False, False, False, False, False]]
    for ids in (newline_ids, [10, 13], torch.tensor([13, 10]), (i for i in (10, 13))):
        assert token_boundaries(token_ids, mask, ids).tolist() == expected


def test_token_boundaries_validation() -> None:
    with pytest.raises(ValueError, match="`boundary_token_ids`"):
        token_boundaries(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), [])
    with pytest.raises(ValueError, match="`mask`"):
        token_boundaries(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2), [1])


# --------------------------------------------------------------------------------------------------
# Entropy segmentation
# --------------------------------------------------------------------------------------------------
def test_entropy_boundaries_definition() -> None:
    entropies = torch.tensor([[0.1, 2.5, 1.0, 3.0, 0.99], [5.0, 5.0, 0.0, 5.0, float("nan")]])
    mask = prefix_mask([5, 3], 5)
    got = entropy_boundaries(entropies, mask, threshold=1.0)
    # Strictly above the threshold: exactly 1.0 nats is not a boundary.
    assert got.tolist() == [[False, True, False, True, False], [True, True, False, False, False]]


@pytest.mark.parametrize("threshold", [0.0, -1.0, float("nan")])
def test_entropy_threshold_validation(threshold: float) -> None:
    with pytest.raises(ValueError, match="`threshold`"):
        entropy_boundaries(torch.zeros(1, 3), torch.ones(1, 3), threshold=threshold)


def test_entropy_shape_mismatch_names_mask() -> None:
    with pytest.raises(ValueError, match="`mask`"):
        entropy_boundaries(torch.zeros(2, 3), torch.ones(3, 3), threshold=1.0)


# --------------------------------------------------------------------------------------------------
# Segment statistics
# --------------------------------------------------------------------------------------------------
def test_segment_lengths_worked_example() -> None:
    boundaries = torch.tensor(
        [
            [True, False, True, False, False, True, False, False],  # L=8, boundaries at 2, 5
            [False, False, False, False, False, False, False, False],  # L=4, no boundary: one segment
            [True, True, True, True, True, True, True, True],  # L=3, t=1, 2 (padding ones ignored)
            [True, True, False, False, False, False, False, False],  # L=0, empty response
        ]
    )
    mask = prefix_mask([8, 4, 3, 0], 8)
    num_boundaries, mean_length = segment_lengths(boundaries, mask)
    assert num_boundaries.tolist() == [2.0, 0.0, 2.0, 0.0]
    assert mean_length.tolist() == pytest.approx([8 / 3, 4.0, 1.0, 0.0])
    assert num_boundaries.dtype == mean_length.dtype == torch.float32


@FAST
@given(
    rows=st.lists(
        st.tuples(st.lists(st.booleans(), min_size=12, max_size=12), st.integers(0, 12)),
        min_size=1,
        max_size=5,
    )
)
def test_property_segment_lengths_match_explicit_split(rows: list[tuple[list[bool], int]]) -> None:
    boundaries = torch.tensor([flags for flags, _ in rows])
    lengths = [length for _, length in rows]
    num_boundaries, mean_length = segment_lengths(boundaries, prefix_mask(lengths, 12))
    for i, (flags, length) in enumerate(rows):
        # Split the valid prefix explicitly: a segment starts at 0 and at every boundary t >= 1.
        starts = [0] + [t for t in range(1, length) if flags[t]]
        pieces = [end - start for start, end in zip(starts, [*starts[1:], length])] if length else []
        assert sum(pieces) == length
        assert num_boundaries[i].item() == (len(starts) - 1 if length else 0)
        expected_mean = sum(pieces) / len(pieces) if pieces else 0.0
        assert mean_length[i].item() == pytest.approx(expected_mean)


@FAST
@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    threshold=st.floats(0.05, 0.95),
)
def test_property_every_segmenter_is_false_on_padding(
    lengths: list[int], seed: int, threshold: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (len(lengths), 20)
    mask = prefix_mask(lengths, 20)
    pad = ~mask.bool()
    # Padding filled with values that would be boundaries if they were valid.
    logprobs = torch.where(pad, -50.0, torch.rand(shape, generator=g).log())
    entropies = torch.where(pad, 50.0, 3 * torch.rand(shape, generator=g))
    token_ids = torch.where(pad, 0, torch.randint(0, 5, shape, generator=g))
    for boundaries in (
        probability_boundaries(logprobs, mask, threshold=threshold),
        uniform_boundaries(mask, segment_length=1 + seed % 7),
        token_boundaries(token_ids, mask, [0, 3]),
        entropy_boundaries(entropies, mask, threshold=1.0),
    ):
        assert boundaries.dtype == torch.bool and boundaries.shape == shape
        assert not boundaries[pad].any()
