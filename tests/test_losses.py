"""The PPO loss terms of trl_sae.trainer.losses against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trl_sae.trainer.losses import (
    clipped_policy_loss,
    clipped_value_loss,
    entropy_bonus,
    kl_penalty,
    masked_mean,
    masked_whiten,
)

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


def test_kl_penalty_estimators():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -2.0]])
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([[1.0, 0.0]]))
    expected_k3 = math.exp(-1.0) - 1 + 1.0
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"), torch.tensor([[expected_k3, 0.0]]))
    with pytest.raises(ValueError, match="'k1' or 'k3'"):
        kl_penalty(logprobs, ref, "k2")
