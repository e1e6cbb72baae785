"""The PPO loss terms of trl_sae.trainer.objectives.losses against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.trainer.objectives.losses import (
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_bonus,
    kl_penalty,
    loss_units,
    masked_mean,
    masked_whiten,
    process_denominator,
)
from trl_sae.trainer.trl_base import TRL_HAS_PPO

MASK = torch.tensor([[True, True, False]])


def test_clipped_policy_loss_takes_the_pessimistic_term_per_token():
    # ratios e^0.5 ~ 1.649 (clipped to 1.2) with A = +1, and e^-0.5 ~ 0.607 (clipped to 0.8) with A = -1:
    # both clipped terms are the pessimistic ones; the masked third token is ignored.
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.5, -0.5, 3.0]])
    advantages = torch.tensor([[1.0, -1.0, 100.0]])
    loss, clipfrac, approx_kl = clipped_policy_loss(new, old, advantages, MASK, cliprange=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert clipfrac.item() == pytest.approx(1.0)
    assert approx_kl.item() == pytest.approx(0.5 * 0.25)
    # with A = -1 on the first token the unclipped -A r = e^0.5 is larger: no clipping there
    loss, clipfrac, _ = clipped_policy_loss(new, old, -advantages, MASK, cliprange=0.2)
    assert loss.item() == pytest.approx((math.exp(0.5) - math.exp(-0.5)) / 2)
    assert clipfrac.item() == pytest.approx(0.0)


def test_clipped_value_loss_and_masked_helpers():
    values = torch.tensor([[1.0, 0.0, 9.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    # token 0: (1-0)^2 vs clipped V=0.5: 0.25 -> 1; token 1: 1 vs 1 -> 1; mean 1, times 0.5
    assert clipped_value_loss(values, old, returns, MASK, cliprange_value=0.5).item() == pytest.approx(0.5)
    assert masked_mean(values, MASK).item() == pytest.approx(0.5)
    assert entropy_bonus(torch.tensor([[2.0, 4.0, 50.0]]), MASK).item() == pytest.approx(3.0)
    whitened = masked_whiten(torch.tensor([[1.0, 3.0, 7.0]]), MASK)
    torch.testing.assert_close(whitened, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


def moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What one process contributes to the whitening all-reduce: (sum, sum of squares, count)."""
    valid = values[mask].double()
    return torch.stack(
        [valid.sum(), (valid**2).sum(), torch.tensor(float(valid.numel()), dtype=torch.float64)]
    )


@st.composite
def two_process_batches(draw):
    """Two processes' rows: different row counts, widths and lengths (some rows empty), scales and offsets."""
    parts = []
    for _ in range(2):
        rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 6))
        lengths = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
        seed, scale = draw(st.integers(0, 2**16)), draw(st.floats(0.1, 100.0))
        offset = draw(st.floats(-50.0, 50.0))
        values = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * scale + offset
        mask = torch.arange(width) < torch.tensor(lengths)[:, None]
        parts.append((values, mask))
    return parts


@settings(max_examples=60, deadline=None)
@given(parts=two_process_batches(), shift_mean=st.booleans(), unbiased=st.booleans())
def test_whitening_over_processes_equals_whitening_the_joined_rows(parts, shift_mean, unbiased):
    (values_a, mask_a), (values_b, mask_b) = parts
    if mask_a.sum() + mask_b.sum() < 2:
        return
    width = max(values_a.shape[1], values_b.shape[1])
    joined_values = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1])) for v, _ in parts])
    joined_mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for _, m in parts])
    joined = masked_whiten(joined_values, joined_mask, shift_mean=shift_mean, unbiased=unbiased)
    for index, (values, mask) in enumerate(parts):
        other = moments(*parts[1 - index])

        def all_reduce_sum(mine: torch.Tensor, other: torch.Tensor = other) -> torch.Tensor:
            return mine + other  # this process's moments plus the other process's

        local = masked_whiten(
            values, mask, shift_mean=shift_mean, unbiased=unbiased, all_reduce_sum=all_reduce_sum
        )
        rows = slice(0, values.shape[0]) if index == 0 else slice(values_a.shape[0], None)
        expected = joined[rows, : values.shape[1]]
        torch.testing.assert_close(local, expected, rtol=1e-4, atol=1e-4)
        assert local[~mask].abs().sum() == 0


def test_reward_whitening_matches_trls_masked_whiten():
    values = torch.tensor([[1.0, 3.0, 7.0, 100.0], [2.0, -4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    ours = masked_whiten(values, mask, shift_mean=False, unbiased=True)
    # by hand: valid values 1, 3, 7, 2, -4: mean 1.8, unbiased variance 62.8 / 4 = 15.7
    valid = torch.tensor([1.0, 3.0, 7.0, 2.0, -4.0])
    torch.testing.assert_close(ours[mask], (valid - 1.8) / math.sqrt(15.7) + 1.8)
    if TRL_HAS_PPO:  # TRL 1.12's PPOTrainer whitens rewards with this function (gone in TRL 1.13)
        from trl.experimental.ppo.ppo_trainer import masked_whiten as trl_masked_whiten

        torch.testing.assert_close(ours[mask], trl_masked_whiten(values, mask, shift_mean=False)[mask])
    # and the advantages' default is the population whitening: mean 0, std 1 over the valid tokens
    whitened = masked_whiten(values, mask)[mask]
    assert whitened.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def test_kl_penalty_estimators():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -2.0]])
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([[1.0, 0.0]]))
    expected_k3 = math.exp(-1.0) - 1 + 1.0
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"), torch.tensor([[expected_k3, 0.0]]))
    with pytest.raises(ValueError, match="'k1' or 'k3'"):
        kl_penalty(logprobs, ref, "k2")


# Two completions of 3 and 1 valid tokens: per-token terms 1, 2, 3 and 4.
AGG_VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
AGG_MASK = torch.tensor([[True, True, True], [True, False, False]])


@pytest.mark.parametrize(
    ("mode", "expected", "units"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4, 4),  # every token weighs the same
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2, 2),  # every completion weighs the same
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) / 5 + 4 / 5) / 2, 2 * 5),  # Dr. GRPO: token sums / 5
    ],
)
def test_each_loss_agg_mode_by_hand_and_split_over_rows(mode, expected, units):
    assert aggregate_loss(AGG_VALUES, AGG_MASK, mode, norm_length=5).item() == pytest.approx(expected)
    assert loss_units(AGG_MASK, mode, norm_length=5).item() == units
    # With the whole batch's count as the denominator, the rows' parts add up to the whole.
    parts = [aggregate_loss(AGG_VALUES[i : i + 1], AGG_MASK[i : i + 1], mode, 5, units) for i in (0, 1)]
    assert sum(parts).item() == pytest.approx(expected)
    # The value loss and the entropy bonus reduce the same way: 0.5 * (V - R)^2 with V - R = the terms' roots.
    values = AGG_VALUES.sqrt() * math.sqrt(2.0)
    value_loss = clipped_value_loss(values, values, torch.zeros(2, 3), AGG_MASK, 1e9, mode, norm_length=5)
    assert value_loss.item() == pytest.approx(expected)
    assert entropy_bonus(AGG_VALUES, AGG_MASK, mode, norm_length=5).item() == pytest.approx(expected)
    # and the policy loss: -A * ratio at ratio 1 with A = -terms
    zeros = torch.zeros(2, 3)
    policy_loss, _, _ = clipped_policy_loss(zeros, zeros, -AGG_VALUES, AGG_MASK, 0.2, mode, norm_length=5)
    assert policy_loss.item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_is_trls_dr_grpo_and_a_row_count_below_verls():
    # Per-token terms 1, 2, 3 | 4 (AGG_VALUES), norm_length 5, 2 rows. Worked by hand:
    #   TRL GRPO loss_type="dr_grpo":  sum / (rows x max_completion_length) = 10 / (2 x 5) = 1.0
    #   verl agg_loss, same mode name: sum / loss_scale_factor               = 10 / 5       = 2.0
    values = AGG_VALUES.clone().requires_grad_(True)
    loss = aggregate_loss(values, AGG_MASK, "seq-mean-token-sum-norm", norm_length=5)
    assert loss.item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx((AGG_VALUES * AGG_MASK).sum().item() / (2 * 5))
    # Each valid token's gradient is 1 / (rows x norm_length) = 0.1, not verl's 1 / norm_length = 0.2.
    loss.backward()
    torch.testing.assert_close(values.grad, AGG_MASK.float() * 0.1)


def test_unknown_loss_agg_mode_is_an_error():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(AGG_VALUES, AGG_MASK, "seq-mean")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(AGG_VALUES, AGG_MASK, "seq-mean-token-sum-norm")


@settings(max_examples=60, deadline=None)
@given(
    processes=st.integers(1, 4),
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    data=st.data(),
)
def test_process_denominators_give_the_one_process_loss_whatever_the_split(processes, mode, data):
    """Each process divides its sum by its share of the global count; DDP's mean of those is the loss of
    one process holding every row, also when the count is below the number of processes (one masked row)."""
    rows = data.draw(st.lists(st.integers(0, 2), min_size=processes, max_size=processes))  # rows per process
    masks = [
        torch.tensor(
            data.draw(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=n, max_size=n))
        ).view(n, 3)
        for n in rows
    ]
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    values = [torch.randn(n, 3, dtype=torch.float64, generator=generator) for n in rows]
    masked = data.draw(st.booleans())  # the positive NLL counts only its masked rows (sum-norm)
    units = sum(loss_units(mask, mode, 3, masked_rows_only=masked) for mask in masks)
    share = process_denominator(torch.as_tensor(units), processes)
    ddp_mean = sum(aggregate_loss(v, m, mode, 3, denominator=share.double()) for v, m in zip(values, masks))
    whole_mask = torch.cat(masks)
    whole = aggregate_loss(
        torch.cat(values), whole_mask, mode, 3, loss_units(whole_mask, mode, 3, masked_rows_only=masked)
    )
    ddp_mean = ddp_mean / processes
    assert float(ddp_mean) == pytest.approx(float(whole), rel=1e-6, abs=1e-9)  # float32 shares


def test_one_positive_row_on_two_processes_is_not_halved():
    # seq-mean-token-mean over a single row (count 1) on 2 processes: each divides by 0.5, DDP halves the sum.
    share = process_denominator(torch.tensor(1.0), 2)
    assert float(share) == 0.5
    loss = aggregate_loss(
        torch.tensor([[2.0, 4.0]]), torch.ones(1, 2), "seq-mean-token-mean", denominator=share
    )
    assert float(loss) / 2 == 3.0  # the row's mean, as one process gets
    assert float(process_denominator(torch.tensor(0.0), 2)) == 0.5  # an empty count counts as 1
