"""The RLVR knobs from DAPO, VAPO and TRL's GRPO (issue 24): clip-higher, overlong reward shaping, masking
truncated completions, the positive-example NLL and the high-entropy token mask.

Each is checked on hand-worked numbers in the pure functions (trainer/objectives/losses.py, trainer/objectives/shaping.py), then
in the trainer's update on the fixed ragged batch of tests/test_loss_aggregation.py (SGD, lr 1, no clipping:
a parameter's change is minus its gradient), and end to end in a short run for its logged metrics.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.generation.capture import forward_logprobs
from trl_sae.trainer.objectives.losses import (
    LOSS_AGG_MODES,
    clip_fractions,
    clipped_policy_loss,
    loss_units,
    positive_nll_loss,
)
from trl_sae.trainer.objectives.shaping import (
    boundary_overlap_counts,
    high_entropy_mask,
    linear_quantile,
    overlong_penalty,
)
from trl_sae.trainer.rollout_batch import RolloutBatch

from .scenarios import in_the_ddp_launch
from .test_loss_aggregation import (
    COMPLETION_LENGTHS,
    fixed_batch,
    relative_difference,
    split_trainer,
    update_delta,
)
from .test_trainer import make_trainer

# ------------------------------------------------------------------------------------------------
# 1. Clip-higher
# ------------------------------------------------------------------------------------------------
RATIOS = torch.tensor([[1.5, 1.25, 0.5]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0]])
ALL_VALID = torch.ones(1, 3, dtype=torch.bool)


def test_clip_higher_on_hand_worked_tokens():
    # eps = 0.2, eps_high = 0.28. Token 0: r = 1.5, A = 1 -> clipped at 1.28 (high); token 1: r = 1.25, A = 1
    # -> inside [0.8, 1.28], unclipped; token 2: r = 0.5, A = -1 -> clipped at 0.8 (low).
    logprobs = RATIOS.log().requires_grad_()
    loss, clipfrac, _ = clipped_policy_loss(
        logprobs, torch.zeros(1, 3), ADVANTAGES, ALL_VALID, cliprange=0.2, cliprange_high=0.28
    )
    assert loss.item() == pytest.approx((-1.28 - 1.25 + 0.8) / 3)
    loss.backward()
    # d(-A r)/d log r = -A r on the unclipped token; the clipped ones pass no gradient.
    assert logprobs.grad.flatten().tolist() == pytest.approx([0.0, -1.25 / 3, 0.0])
    assert clipfrac.item() == pytest.approx(2 / 3)
    low, high = clip_fractions(logprobs, torch.zeros(1, 3), ADVANTAGES, ALL_VALID, 0.2, 0.28)
    assert (low.item(), high.item()) == pytest.approx((1 / 3, 1 / 3))

    # Symmetric clipping (the default) clips token 1 at 1.2 as well: no gradient anywhere.
    symmetric = RATIOS.log().requires_grad_()
    loss, _, _ = clipped_policy_loss(symmetric, torch.zeros(1, 3), ADVANTAGES, ALL_VALID, cliprange=0.2)
    assert loss.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3)
    loss.backward()
    assert symmetric.grad.abs().max().item() == 0.0
    low, high = clip_fractions(symmetric, torch.zeros(1, 3), ADVANTAGES, ALL_VALID, 0.2)
    assert (low.item(), high.item()) == pytest.approx((1 / 3, 2 / 3))


@st.composite
def policy_batches(draw):
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    mask = torch.arange(width)[None] < lengths[:, None]
    logprobs = 0.5 * torch.randn(rows, width, generator=generator)
    old = 0.5 * torch.randn(rows, width, generator=generator)
    advantages = torch.randn(rows, width, generator=generator)
    return logprobs, old, advantages, mask


@settings(max_examples=60, deadline=None)
@given(
    batch=policy_batches(),
    cliprange=st.floats(0.01, 0.5),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_cliprange_high_equal_to_cliprange_is_the_symmetric_loss_exactly(batch, cliprange, mode):
    logprobs, old, advantages, mask = batch
    agg = {"loss_agg_mode": mode, "norm_length": 6}
    default = clipped_policy_loss(logprobs, old, advantages, mask, cliprange, **agg)
    same = clipped_policy_loss(logprobs, old, advantages, mask, cliprange, **agg, cliprange_high=cliprange)
    assert all(torch.equal(a, b) for a, b in zip(default, same))
    # and the split clip fractions add up to the clipfrac, whatever eps_high is
    for high_range in (cliprange, 2 * cliprange):
        _, clipfrac, _ = clipped_policy_loss(
            logprobs, old, advantages, mask, cliprange, cliprange_high=high_range
        )
        low, high = clip_fractions(logprobs, old, advantages, mask, cliprange, high_range)
        assert (low + high).item() == pytest.approx(clipfrac.item(), abs=1e-6)


def test_clip_higher_changes_the_update(tmp_path, tokenizer):
    trainer = split_trainer(str(tmp_path), tokenizer, rows=8)
    batch = fixed_batch(trainer)  # |log r| ~ 0.05: a range of 0.01 clips most tokens
    default = update_delta(trainer, batch, cliprange=0.01)
    same = update_delta(trainer, batch, cliprange=0.01, cliprange_high=0.01)
    higher = update_delta(trainer, batch, cliprange=0.01, cliprange_high=0.5)
    assert torch.equal(default, same)
    assert relative_difference(higher, default) > 1e-2


# ------------------------------------------------------------------------------------------------
# 2. Overlong reward shaping
# ------------------------------------------------------------------------------------------------
def test_overlong_penalty_on_hand_worked_lengths():
    # M = 10, B = 4: free up to 6 tokens, then -(L - 6) / 4 x 0.5, down to -0.5 at L = 10.
    penalty = overlong_penalty(
        torch.tensor([3, 6, 7, 8, 10]), response_length=10, buffer_length=4, penalty_factor=0.5
    )
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])


@settings(max_examples=50, deadline=None)
@given(
    response_length=st.integers(2, 64),
    data=st.data(),
    factor=st.floats(0.1, 5.0),
)
def test_overlong_penalty_is_trl_soft_overlong_punishment_times_the_factor(response_length, data, factor):
    from trl.rewards import get_soft_overlong_punishment

    buffer = data.draw(st.integers(1, response_length - 1))
    lengths = data.draw(st.lists(st.integers(0, response_length), min_size=1, max_size=8))
    trl = get_soft_overlong_punishment(response_length, buffer)([[1] * n for n in lengths])
    ours = overlong_penalty(torch.tensor(lengths), response_length, buffer, factor)
    assert ours.tolist() == pytest.approx([factor * value for value in trl], abs=1e-6)


def test_overlong_penalty_enters_the_reward_and_is_logged_apart(tmp_path, tokenizer):
    # stop_token=None: every completion runs to response_length = 8, so each gets the full -0.5.
    trainer = make_trainer(
        tmp_path, tokenizer, max_steps=1, overlong_buffer_length=4, overlong_penalty_factor=0.5
    )
    batches = []
    score = trainer.rollouts.score
    trainer.rollouts.score = lambda batch, **kw: (score(batch, **kw), batches.append(batch))[0]
    trainer.train()
    (log,) = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    assert log["reward/overlong_penalty"] == pytest.approx(-0.5)
    assert log["reward/mean"] == pytest.approx(log["reward/task_mean"] - 0.5)
    assert log["reward/task_mean"] == pytest.approx(log["reward/vowel_fraction/mean"])
    (batch,) = batches
    assert batch.lengths.tolist() == [8] * 8
    assert batch.overlong_penalty.tolist() == [-0.5] * 8


# ------------------------------------------------------------------------------------------------
# 3. Truncated completions
# ------------------------------------------------------------------------------------------------
TRUNCATED = torch.tensor(
    [True, False, False, True, False, True, False, False]
)  # rows 0, 3 (12 tokens), 5 (1)


def critic_and_actor(trainer, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a parameter delta of :func:`update_delta` into the actor's and the critic's parts."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    actor = {id(p) for p in unwrapped.actor_parameters()}
    trainable = [p for p in unwrapped.parameters() if p.requires_grad]
    is_actor = torch.cat([torch.full((p.numel(),), id(p) in actor) for p in trainable])
    return delta[is_actor], delta[~is_actor]


def test_mask_truncated_completions_drops_them_from_the_policy_loss_only(tmp_path, tokenizer, monkeypatch):
    trainer = split_trainer(str(tmp_path), tokenizer, rows=8)
    batch = fixed_batch(trainer)
    batch.is_truncated = TRUNCATED.clone()
    denominators = []
    ppo_loss = trainer.ppo_update.loss
    monkeypatch.setattr(
        trainer.ppo_update,
        "loss",
        lambda *a, **kw: (denominators.append(kw["denominator"]), ppo_loss(*a, **kw))[1],
    )
    masked = update_delta(trainer, batch, mask_truncated_completions=True)
    # Hand count: 38 valid tokens; the truncated rows hold 12 + 12 + 1 of them.
    assert sum(COMPLETION_LENGTHS) == 38
    assert denominators[-1]["policy"].item() == 38 - 25
    assert denominators[-1]["value"].item() == 38

    # The actor moves as on the batch without the truncated rows; the critic as on the whole batch.
    kept = torch.nonzero(~TRUNCATED).flatten()
    subset = fixed_batch(trainer, kept)
    actor, critic = critic_and_actor(trainer, masked)
    actor_kept, _ = critic_and_actor(trainer, update_delta(trainer, subset))
    actor_all, critic_all = critic_and_actor(trainer, update_delta(trainer, batch))
    assert relative_difference(actor, actor_kept) < 1e-5
    assert relative_difference(critic, critic_all) < 1e-5
    assert relative_difference(actor, actor_all) > 1e-2
    # off (the default): truncated rows train like any other
    assert torch.equal(
        update_delta(trainer, batch), update_delta(trainer, batch, mask_truncated_completions=False)
    )


# ------------------------------------------------------------------------------------------------
# 5. Positive-example NLL
# ------------------------------------------------------------------------------------------------
def test_positive_nll_loss_on_hand_worked_rows():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss = positive_nll_loss(logprobs, mask)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 0.5) / 3)  # token-mean over the 3 positive tokens
    loss.backward()
    assert logprobs.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 0.0, -1 / 3, 0.0, 0.0])
    seq = positive_nll_loss(logprobs, mask, "seq-mean-token-mean")
    assert seq.item() == pytest.approx(((1.0 + 2.0) / 2 + 0.5) / 2)
    # Dr. GRPO's form over the positive set: the positive rows' token sums / (positive rows x norm_length),
    # here 2 of 3 rows (the third has no positive token)
    rows = torch.cat([logprobs.detach(), torch.tensor([[-4.0, -4.0, -4.0]])])
    positive = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    norm = positive_nll_loss(rows, positive, "seq-mean-token-sum-norm", norm_length=4)
    assert norm.item() == pytest.approx((1.0 + 2.0 + 0.5) / (2 * 4))
    assert loss_units(positive, "seq-mean-token-sum-norm", 4, masked_rows_only=True).item() == 2 * 4
    assert loss_units(positive, "seq-mean-token-sum-norm", 4).item() == 3 * 4  # the policy's: every row
    for mode in ("token-mean", "seq-mean-token-mean"):  # these count the masked rows' units either way
        assert loss_units(positive, mode, 4, masked_rows_only=True) == loss_units(positive, mode, 4)


SCORES = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.2])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_positive_nll_trains_the_policy_towards_the_rewarded_completions(tmp_path, tokenizer, mode):
    trainer = split_trainer(str(tmp_path), tokenizer, rows=8)
    batch = fixed_batch(trainer)
    batch.scores = SCORES.clone()
    batch.advantages = torch.zeros_like(
        batch.advantages
    )  # no surrogate gradient: only the NLL moves the actor
    coef, threshold = 0.1, 0.4
    delta = update_delta(
        trainer, batch, positive_nll_coef=coef, positive_nll_threshold=threshold, entropy_coef=0.0,
        loss_agg_mode=mode,
    )  # fmt: skip
    actor, _ = critic_and_actor(trainer, delta)

    # By hand: rows 0, 2, 4, 5 score above 0.4; SGD at lr 1 moves by -coef x the gradient of their negative
    # log-likelihood (at the rollout temperature, as the update's forward), normalised over those 4 rows:
    # their 1 + 2 + 3 + 12 + ... tokens, or 4 rows (x response_length 12), never the batch's 8 rows.
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    positive = batch.mask & (batch.scores > threshold)[:, None]
    logprobs, _ = forward_logprobs(
        unwrapped.policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
        temperature=trainer.args.temperature,
    )  # fmt: skip
    row_sums = (logprobs * positive).sum(dim=1)
    nll = -{
        "token-mean": row_sums.sum() / positive.sum(),
        "seq-mean-token-mean": (row_sums / positive.sum(dim=1).clamp_min(1)).sum() / 4,
        "seq-mean-token-sum-norm": row_sums.sum() / (4 * 12),
    }[mode]
    actor_ids = {id(p) for p in unwrapped.actor_parameters()}
    actor_params = [p for p in unwrapped.parameters() if p.requires_grad and id(p) in actor_ids]
    grads = torch.autograd.grad(nll, actor_params, allow_unused=True)
    expected = torch.cat(
        [
            (-coef * (g if g is not None else torch.zeros_like(p))).flatten()
            for p, g in zip(actor_params, grads)
        ]
    )
    assert expected.abs().max() > 1e-4
    assert relative_difference(actor, expected) < 1e-4
    off, _ = critic_and_actor(trainer, update_delta(trainer, batch, entropy_coef=0.0))
    assert off.abs().max() == 0.0  # without the NLL (the default) the actor stays put


# ------------------------------------------------------------------------------------------------
# 6. High-entropy token mask
# ------------------------------------------------------------------------------------------------
def test_high_entropy_mask_and_boundary_overlap_on_hand_worked_tokens():
    entropies = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    # valid entropies sorted: 0.1 0.3 0.5 0.7 0.9; the 0.6-quantile is 0.5 + 0.4 x 0.2 = 0.58
    kept = high_entropy_mask(entropies, mask, quantile=0.4)
    assert kept.tolist() == [[False, False, True, False], [True, False, False, False]]
    assert high_entropy_mask(entropies, mask, quantile=1.0).equal(mask)  # 1.0 keeps every valid token
    boundaries = torch.tensor([[True, True, True, False], [True, True, False, False]])
    # counted at t >= 1 on valid tokens: (0, 1) and (0, 2); only (0, 2) is kept
    assert boundary_overlap_counts(boundaries, kept, mask).tolist() == [1.0, 2.0]


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(0.0, 20.0), min_size=1, max_size=40), q=st.floats(0.0, 1.0))
def test_linear_quantile_is_torch_quantile(values, q):
    tensor = torch.tensor(values, dtype=torch.float64)
    assert linear_quantile(tensor, q).item() == pytest.approx(torch.quantile(tensor, q).item(), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(batch=policy_batches(), quantile=st.floats(0.05, 1.0))
def test_high_entropy_mask_keeps_about_the_quantile_and_everything_at_one(batch, quantile):
    entropies, _, _, mask = batch
    entropies = entropies.abs()
    kept = high_entropy_mask(entropies, mask, quantile)
    assert not (kept & ~mask).any()
    if quantile == 1.0:
        assert kept.equal(mask)
    count = int(mask.sum())
    if (
        count
    ):  # distinct values: n - ceil((1 - q)(n - 1)) tokens, in [q (n - 1), q (n - 1) + 1] (+-1 for rounding)
        assert quantile * (count - 1) - 1 <= int(kept.sum()) <= quantile * (count - 1) + 1 + 1e-6
        # and it is the top of the entropies: every kept token has at least the entropy of every dropped one
        if kept.any() and (mask & ~kept).any():
            assert entropies[kept].min() >= entropies[mask & ~kept].max()


BATCH_FIELDS = (
    "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "entropies", "is_truncated",
    "scores", "advantages", "values", "returns",
)  # fmt: skip


def entropy_batch(trainer, rows: torch.Tensor | None = None) -> RolloutBatch:
    """The fixed batch with distinct entropies in [0, 3), rows 0, 3 and 5 truncated and SCORES (``rows``: a
    process's share)."""
    batch = fixed_batch(trainer)
    generator = torch.Generator().manual_seed(2)
    batch.entropies = torch.where(batch.mask, torch.rand(batch.mask.shape, generator=generator) * 3, 0.0)
    batch.is_truncated = TRUNCATED.clone()
    batch.scores = SCORES.clone()
    if rows is not None:
        for name in BATCH_FIELDS:
            setattr(batch, name, getattr(batch, name)[rows])
    return batch


def test_top_entropy_quantile_trains_the_policy_on_the_high_entropy_tokens_only(tmp_path, tokenizer):
    trainer = split_trainer(str(tmp_path), tokenizer, rows=8)
    batch = entropy_batch(trainer)
    masked = update_delta(trainer, batch, top_entropy_quantile=0.3, entropy_coef=0.0)
    kept = batch.loss_masks["high_entropy"]
    assert int(kept.sum()) == math.floor(0.3 * 37) + 1  # 38 distinct entropies: the top 30%
    # Same as zeroing the advantages of the other tokens (their terms add 0, the denominator stays 38 tokens).
    zeroed = entropy_batch(trainer)
    zeroed.advantages = torch.where(kept, batch.advantages, 0.0)
    actor, critic = critic_and_actor(trainer, masked)
    actor_zeroed, critic_zeroed = critic_and_actor(trainer, update_delta(trainer, zeroed, entropy_coef=0.0))
    actor_all, _ = critic_and_actor(trainer, update_delta(trainer, batch, entropy_coef=0.0))
    assert relative_difference(actor, actor_zeroed) < 1e-5
    assert torch.equal(critic, critic_zeroed)  # the critic is not masked
    assert relative_difference(actor, actor_all) > 1e-2


def test_the_entropy_mask_is_the_rollouts_in_every_ppo_epoch(tmp_path, tokenizer, monkeypatch):
    """The mask is taken once per step from the rollout's entropies (``batch.entropies``), not from the
    current policy's at each epoch (TRL's per-micro-batch forward): two epochs train the same tokens, as two
    epochs with the other tokens' advantages zeroed, though the first epoch moved the policy."""
    from trl_sae.trainer.parts import update

    trainer = split_trainer(str(tmp_path), tokenizer, rows=8)
    seen: list[torch.Tensor] = []

    def recording(entropies, *args, **kwargs):
        seen.append(entropies)
        return high_entropy_mask(entropies, *args, **kwargs)

    monkeypatch.setattr(update, "high_entropy_mask", recording)
    batch = entropy_batch(trainer)
    masked = update_delta(trainer, batch, top_entropy_quantile=0.3, entropy_coef=0.0, num_ppo_epochs=2)
    assert len(seen) == 1 and seen[0] is batch.entropies  # one mask per step, from the rollout's entropies
    kept = batch.loss_masks["high_entropy"]
    zeroed = entropy_batch(trainer)
    zeroed.advantages = torch.where(kept, batch.advantages, 0.0)
    actor, _ = critic_and_actor(trainer, masked)
    actor_zeroed, _ = critic_and_actor(
        trainer, update_delta(trainer, zeroed, entropy_coef=0.0, num_ppo_epochs=2)
    )
    assert relative_difference(actor, actor_zeroed) < 1e-5
    # the current policy's entropies would pick other tokens: the model's own top 30% differs from the mask
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    with torch.no_grad():
        _, current = forward_logprobs(
            policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
            temperature=trainer.args.temperature, return_entropy=True,
        )  # fmt: skip
    assert not high_entropy_mask(current, batch.loss_masks["policy"], 0.3).equal(kept)


def test_rlvr_knobs_log_their_metrics_in_a_training_run(tmp_path, tokenizer):
    trainer = make_trainer(
        tmp_path, tokenizer, max_steps=1, cliprange_high=0.28, top_entropy_quantile=0.25, positive_nll_coef=0.1,
        positive_nll_threshold=-1.0, segmentation="entropy", entropy_threshold=2.0,
    )  # fmt: skip
    batches = []
    log_step = trainer._log_step
    trainer._log_step = lambda batch, stats: (batches.append(batch), log_step(batch, stats))[1]
    trainer.train()
    (log,) = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    assert log["policy/clipfrac_low"] + log["policy/clipfrac_high"] == pytest.approx(log["policy/clipfrac"])
    assert math.isfinite(log["loss/positive_nll"]) and log["loss/positive_nll"] > 0
    (batch,) = batches
    policy, kept = batch.loss_masks["policy"], batch.loss_masks["high_entropy"]
    assert log["policy/entropy_mask_fraction"] == pytest.approx(kept.sum().item() / policy.sum().item())
    assert 0.2 < log["policy/entropy_mask_fraction"] < 0.3
    inside, total = boundary_overlap_counts(batch.boundaries, kept, policy).tolist()
    assert total > 0
    assert log["policy/boundaries_in_entropy_mask"] == pytest.approx(inside / total)


# ------------------------------------------------------------------------------------------------
# Config: every knob rejected out of range in one line naming it
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"cliprange_high": 0.0}, "cliprange_high"),
        ({"overlong_buffer_length": 8}, "overlong_buffer_length"),  # response_length = 8
        ({"overlong_buffer_length": -1}, "overlong_buffer_length"),
        ({"overlong_penalty_factor": 2.0}, "overlong_penalty_factor"),  # without a buffer
        ({"overlong_buffer_length": 2, "overlong_penalty_factor": 0.0}, "overlong_penalty_factor"),
        ({"positive_nll_coef": -0.1}, "positive_nll_coef"),
        ({"positive_nll_threshold": 0.5}, "positive_nll_threshold"),  # without a coefficient
        ({"top_entropy_quantile": 0.0}, "top_entropy_quantile"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions"),  # stop_token=None
    ],
)
def test_bad_knob_values_fail_in_the_config_naming_the_field(tmp_path, overrides, field):
    from .test_trainer import make_config

    with pytest.raises(ValueError, match=rf"^SAEPPOConfig\.{field}\b") as error:
        make_config(tmp_path, **overrides)
    assert "\n" not in str(error.value)
    make_config(tmp_path, mask_truncated_completions=True, stop_token="eos")  # with a stop token: accepted


# ------------------------------------------------------------------------------------------------
# Two processes with uneven work
# ------------------------------------------------------------------------------------------------
KNOBS = {
    "mask_truncated_completions": True,
    "positive_nll_coef": 0.1,
    "positive_nll_threshold": 0.4,
    "top_entropy_quantile": 0.3,
    "cliprange": 0.01,
    "cliprange_high": 0.05,
}


def with_metric_inputs(batch: RolloutBatch, rows: torch.Tensor | None = None) -> RolloutBatch:
    """Boundaries where the entropy is above 1.5 and an overlong penalty of -0.1 x row, for the knobs' metrics."""
    batch.boundaries = batch.mask & (batch.entropies > 1.5)
    penalty = -0.1 * torch.arange(len(TRUNCATED), dtype=torch.float)
    batch.overlong_penalty = penalty if rows is None else penalty[rows]
    return batch


TWO_RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.set_num_threads(1)
    from trl_sae.demo.tiny import build_char_tokenizer
    from trl_sae.trainer.objectives.losses import LOSS_AGG_MODES
    from tests.test_loss_aggregation import split_trainer, update_delta
    from tests.test_rlvr_knobs import KNOBS, entropy_batch, with_metric_inputs

    rank = int(os.environ["RANK"])
    trainer = split_trainer(sys.argv[1], build_char_tokenizer(), rows=4)
    # Rank 0 holds 27 valid tokens (2 truncated rows), rank 1 holds 11 (1 truncated row).
    batch = entropy_batch(trainer, torch.arange(4 * rank, 4 * rank + 4))
    deltas = {
        (mode, name): update_delta(trainer, batch, loss_agg_mode=mode, **KNOBS, **settings)
        for mode in LOSS_AGG_MODES
        for name, settings in {"rows": {}, "budget": {"max_tokens_per_microbatch": 20}}.items()
    }
    # the knobs' metrics of the last update's masks, gathered over both ranks
    metrics = trainer._rlvr_knob_metrics(with_metric_inputs(batch, torch.arange(4 * rank, 4 * rank + 4)), {})
    torch.save((deltas, metrics), os.path.join(sys.argv[1], f"knobs{rank}.pt"))
    """
)


@in_the_ddp_launch("rlvr_knobs")
def test_two_uneven_processes_apply_the_knobs_as_one_process_holding_both(ddp_launch, tmp_path, tokenizer):
    """The knobs' counts (policy tokens without truncated rows, positive rows) and the entropy quantile span
    both processes, so 2 gloo ranks with 27 and 11 tokens move the weights as one process with all 38."""
    ranks, metrics = zip(*(torch.load(ddp_launch / "rlvr_knobs" / f"knobs{r}.pt") for r in (0, 1)))
    trainer = split_trainer(str(tmp_path / "one"), tokenizer, rows=8)
    batch = entropy_batch(trainer)
    update_delta(trainer, batch, loss_agg_mode=LOSS_AGG_MODES[-1], **KNOBS)  # the ranks' last masks
    whole_metrics = trainer._rlvr_knob_metrics(with_metric_inputs(batch), {})
    assert set(whole_metrics) == {
        "reward/overlong_penalty", "reward/task_mean", "policy/entropy_mask_fraction",
        "policy/boundaries_in_entropy_mask",
    }  # fmt: skip
    assert metrics[0] == metrics[1] == pytest.approx(whole_metrics)
    assert whole_metrics["reward/overlong_penalty"] == pytest.approx(-0.35)  # -0.1 x mean(0..7)
    for mode in LOSS_AGG_MODES:
        whole = update_delta(trainer, batch, loss_agg_mode=mode, **KNOBS)
        assert relative_difference(whole, update_delta(trainer, batch, loss_agg_mode=mode)) > 1e-2
        for name in ("rows", "budget"):
            assert torch.equal(ranks[0][mode, name], ranks[1][mode, name])
            assert relative_difference(ranks[0][mode, name], whole) < 1e-5, (mode, name)
