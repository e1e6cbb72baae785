"""The variation-point registries: a user-registered advantage estimator and segmenter each run end to end
in a training run, the trainer asks their declared capabilities (critic, whitening) instead of their names,
and registry misuse fails early with one clear message."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from trl_sae import (
    ADVANTAGE_ESTIMATORS,
    SEGMENTERS,
    SAEPPOConfig,
    get_estimator_spec,
    get_segmenter,
    get_segmenter_spec,
    probability_boundaries,
    register_advantage_estimator,
    register_segmenter,
    sae_advantages,
)
from trl_sae.core.advantages import gae_advantages
from trl_sae.hub import estimator_settings

from .test_trainer import make_config, make_trainer, parameters_of


@pytest.fixture
def unregister():
    """Names registered by a test, removed afterwards so tests stay independent."""
    names: list[tuple[dict, str]] = []
    yield lambda registry, name: names.append((registry, name))
    for registry, name in names:
        registry.pop(name, None)


def record_batches(trainer) -> list:
    """Keep every step's RolloutBatch once its advantages are computed."""
    batches = []
    compute = trainer._compute_advantages

    def recording(batch):
        compute(batch)
        batches.append(batch)

    trainer._compute_advantages = recording
    return batches


def step_log(trainer) -> dict:
    """The one training log entry of a one-step run."""
    (log,) = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    return log


# ------------------------------------------------------------------------------------------------
# Built-in capabilities, as declared at registration
# ------------------------------------------------------------------------------------------------
def test_builtin_estimators_declare_their_capabilities():
    declared = {
        name: (
            spec.needs_critic,
            spec.whitens,
            spec.needs_boundaries,
            spec.token_rewards,
            spec.min_generations,
        )
        for name, spec in ADVANTAGE_ESTIMATORS.items()
        if name in ("sae", "gae", "mc", "adaptive_lambda", "grpo")
    }
    assert declared == {
        "sae": (True, True, True, True, 1),
        "gae": (True, True, False, True, 1),
        "mc": (True, True, False, True, 1),
        "adaptive_lambda": (True, True, False, True, 1),
        "grpo": (False, False, False, False, 2),
    }
    assert get_estimator_spec("mc").reads == {"rewards", "values", "mask", "gamma"}
    assert {"probability", "uniform", "newline", "entropy"} <= set(SEGMENTERS)
    assert get_segmenter_spec("probability").reads == {"logprobs", "mask", "segment_threshold"}
    assert get_segmenter_spec("newline").reads == {"token_ids", "mask", "newline_token_ids"}


def test_builtin_segmenters_dispatch_to_their_functions():
    logprobs = torch.tensor([[-0.1, -3.0, -1.0, -2.0], [-5.0, -0.2, -0.3, -9.0]])
    entropies = torch.tensor([[0.5, 2.0, 0.1, 3.0], [1.5, 0.2, 0.3, 9.0]])
    token_ids = torch.tensor([[5, 7, 9, 7], [7, 5, 0, 0]])
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    inputs = dict(
        logprobs=logprobs,
        entropies=entropies,
        token_ids=token_ids,
        mask=mask,
        newline_token_ids=torch.tensor([7]),
        segment_threshold=0.2,
        segment_length=2,
        entropy_threshold=1.0,
    )
    expected = {
        # exp(-3), exp(-2) < 0.2 (row 0); exp(-5) < 0.2 and exp(-9) is padding (row 1)
        "probability": [[False, True, False, True], [True, False, False, False]],
        "uniform": [[True, False, True, False], [True, False, False, False]],
        "newline": [[False, True, False, True], [True, False, False, False]],
        "entropy": [[False, True, False, True], [True, False, False, False]],
    }
    for name, boundaries in expected.items():
        assert get_segmenter_spec(name)(**inputs).tolist() == boundaries, name
    assert get_segmenter("probability") is not None
    assert torch.equal(
        get_segmenter_spec("probability")(**inputs), probability_boundaries(logprobs, mask, threshold=0.2)
    )


# ------------------------------------------------------------------------------------------------
# A user-registered estimator, end to end
# ------------------------------------------------------------------------------------------------
def test_registered_critic_free_estimator_builds_no_critic_and_trains(tmp_path, tokenizer, unregister):
    calls = []

    def batch_mean_baseline(*, scores, mask, values, **_):
        """REINFORCE with the batch-mean baseline on every valid token: no critic, not whitened."""
        calls.append({"values": values.clone(), "mask": mask.clone()})
        per_response = scores - scores.mean()
        advantages = torch.where(mask, per_response.unsqueeze(1), torch.zeros(()))
        return advantages, advantages

    register_advantage_estimator(
        "batch_mean_test", batch_mean_baseline, needs_critic=False, whitens=False, token_rewards=False
    )
    unregister(ADVANTAGE_ESTIMATORS, "batch_mean_test")
    assert get_estimator_spec("batch_mean_test").reads == {"scores", "mask", "values"}

    trainer = make_trainer(tmp_path, tokenizer, advantage_estimator="batch_mean_test", max_steps=1)
    assert trainer.value_model is None and not trainer.args.uses_critic
    batches = record_batches(trainer)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    before = parameters_of(policy)
    trainer.train()

    assert len(calls) == 1 and not calls[0]["values"].any()  # no critic: values are all zero
    batch = batches[0]
    expected = batch.scores - batch.scores.mean()
    assert batch.scores.std() > 0  # the vowel reward varies, so the advantages are not all 0
    # Not whitened (whitens=False): the advantages are the estimator's, token for token.
    torch.testing.assert_close(
        batch.advantages[batch.mask], expected.unsqueeze(1).expand_as(batch.mask)[batch.mask]
    )
    assert torch.equal(batch.advantages, batch.raw_advantages)
    log = step_log(trainer)
    assert "loss/value" not in log and math.isfinite(log["loss/policy"])
    after = parameters_of(policy)
    assert any(not torch.equal(before[name], after[name]) for name in before), "the policy did not move"


def test_registered_critic_based_estimator_gets_a_critic_and_whitening(tmp_path, tokenizer, unregister):
    # Default capabilities: a critic, whitened advantages. TD(0) is GAE with lambda = 0.
    register_advantage_estimator("td0_test")(
        lambda *, rewards, values, mask, gamma, **_: gae_advantages(
            rewards, values, mask, lam=0.0, gamma=gamma
        )
    )
    unregister(ADVANTAGE_ESTIMATORS, "td0_test")
    trainer = make_trainer(tmp_path, tokenizer, advantage_estimator="td0_test", max_steps=2)
    assert trainer.value_model is not None
    batches = record_batches(trainer)
    trainer.train()
    # The value head starts at 0; after one critic update the second step's values are the critic's.
    batch = batches[1]
    assert batch.values[batch.mask].abs().min() > 0  # the critic's values reached the estimator
    raw, _ = gae_advantages(batch.token_rewards, batch.values, batch.mask, lam=0.0, gamma=1.0)
    torch.testing.assert_close(batch.raw_advantages, raw)
    # Whitened over the batch's valid tokens (population variance), as the built-in estimators are.
    valid = raw[batch.mask]
    assert valid.std().item() < 0.5  # so whitening changes them
    expected = (valid - valid.mean()) / (valid.var(unbiased=False) + 1e-8).sqrt()
    torch.testing.assert_close(batch.advantages[batch.mask], expected, rtol=1e-4, atol=1e-5)
    assert all("loss/value" in entry for entry in trainer.state.log_history if "reward/mean" in entry)


def test_config_validates_declared_capabilities_not_names(tmp_path, unregister):
    register_advantage_estimator(
        "outcome_only_test",
        lambda *, scores, mask, **_: (mask * scores.unsqueeze(1), mask * scores.unsqueeze(1)),
        needs_critic=False,
        whitens=False,
        token_rewards=False,
        min_generations=3,
    )
    unregister(ADVANTAGE_ESTIMATORS, "outcome_only_test")
    name = dict(advantage_estimator="outcome_only_test")
    for overrides, field in (
        ({"kl_coef": 0.1}, "kl_coef"),
        ({"whiten_rewards": True}, "whiten_rewards"),
        ({"value_warmup_steps": 2}, "value_warmup_steps"),
        ({"num_generations": 2, "per_device_train_batch_size": 8}, "num_generations >= 3"),
    ):
        with pytest.raises(ValueError, match=f"{field}.*'outcome_only_test'|'outcome_only_test'.*{field}"):
            make_config(tmp_path, **name, **overrides)
    assert make_config(tmp_path, **name, num_generations=4).uses_critic is False
    # The card lists only what this estimator reads: no lam, gamma, critic or segmentation settings.
    card = estimator_settings(make_config(tmp_path, **name))
    assert not {"lam", "gamma", "critic_lam", "whiten_advantages", "segmentation"} & set(card["estimator"])
    assert not {"critic_learning_rate", "vf_coef"} & set(card["optimisation"])


# ------------------------------------------------------------------------------------------------
# A user-registered segmenter, end to end
# ------------------------------------------------------------------------------------------------
def test_registered_segmenter_receives_the_documented_inputs_and_drives_sae(tmp_path, tokenizer, unregister):
    seen = []

    @register_segmenter("odd_positions_test")
    def odd_positions(*, logprobs, entropies, token_ids, mask, segment_threshold, **rest):
        seen.append(dict(logprobs=logprobs, entropies=entropies, token_ids=token_ids, mask=mask, **rest))
        seen[-1]["segment_threshold"] = segment_threshold
        # Every odd position opens a segment, padding included (the registry clears it).
        return (torch.arange(mask.shape[1]) % 2 == 1).expand_as(mask).clone()

    unregister(SEGMENTERS, "odd_positions_test")
    trainer = make_trainer(
        tmp_path, tokenizer, segmentation="odd_positions_test", segment_threshold=0.3, lam=0.5, max_steps=1
    )
    assert not hasattr(trainer, "newline_token_ids")  # not read, so never built from the tokenizer
    batches = record_batches(trainer)
    trainer.train()

    batch = batches[0]
    inputs = seen[0]
    assert torch.equal(inputs["logprobs"], batch.logprobs) and torch.equal(
        inputs["entropies"], batch.entropies
    )
    assert torch.equal(inputs["token_ids"], batch.completion_ids) and torch.equal(inputs["mask"], batch.mask)
    assert inputs["mask"].dtype == torch.bool and inputs["token_ids"].shape == batch.mask.shape == (8, 8)
    assert inputs["newline_token_ids"] is None
    assert (inputs["segment_threshold"], inputs["segment_length"], inputs["entropy_threshold"]) == (
        0.3,
        200,
        1.0,
    )

    odd = (torch.arange(8) % 2 == 1).expand(8, 8) & batch.mask
    assert torch.equal(batch.boundaries, odd)
    # The boundaries reach SAE: the actor's advantages are SAE's with exactly these boundaries.
    sae, _ = sae_advantages(batch.token_rewards, batch.values, batch.mask, odd, lam=0.5)
    torch.testing.assert_close(batch.raw_advantages, sae)
    gae, _ = gae_advantages(batch.token_rewards, batch.values, batch.mask, lam=0.5)
    assert not torch.allclose(batch.raw_advantages, gae)  # boundaries at every token would be GAE
    log = step_log(trainer)
    # 8-token completions (no stop token): boundaries at t = 1, 3, 5, 7.
    assert log["completions/mean_length"] == 8.0
    assert log["segments/boundaries_per_completion"] == pytest.approx(4.0)


def test_registered_segmenter_naming_newline_token_ids_gets_them(tmp_path, tokenizer, unregister):
    register_segmenter(
        "after_newline_test",
        lambda *, token_ids, mask, newline_token_ids, **_: torch.isin(token_ids, newline_token_ids) & mask,
    )
    unregister(SEGMENTERS, "after_newline_test")
    trainer = make_trainer(tmp_path, tokenizer, segmentation="after_newline_test")
    expected = sorted(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))
    assert expected and sorted(trainer.newline_token_ids) == expected


# ------------------------------------------------------------------------------------------------
# Registry errors
# ------------------------------------------------------------------------------------------------
def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="advantage estimator named 'grpo' is already registered"):
        register_advantage_estimator("grpo", lambda **_: None, needs_critic=False)
    with pytest.raises(ValueError, match="segmenter named 'uniform' is already registered"):
        register_segmenter("uniform", lambda **_: None)
    assert get_segmenter_spec("uniform").fn.__name__ == "_uniform_segmenter"  # the built-in is untouched


def test_unknown_names_list_the_registered_ones(tmp_path, unregister):
    with pytest.raises(ValueError, match=r"Unknown segmenter 'sentences'.*'entropy'.*register_segmenter"):
        get_segmenter("sentences")
    with pytest.raises(ValueError, match=r"Unknown advantage estimator 'vtrace'.*'grpo'"):
        get_estimator_spec("vtrace")
    with pytest.raises(
        ValueError, match=r"SAEPPOConfig\.segmentation: 'sentences' is unknown.*register_segmenter"
    ):
        make_config(tmp_path, segmentation="sentences")
    # Registered before the config is built: accepted.
    register_segmenter("sentences", lambda *, mask, **_: mask.clone())
    unregister(SEGMENTERS, "sentences")
    assert make_config(tmp_path, segmentation="sentences").segmentation == "sentences"
    assert isinstance(make_config(tmp_path, segmentation="sentences"), SAEPPOConfig)


def test_bad_registrations_fail_at_registration():
    with pytest.raises(TypeError, match=r"'no_kwargs_test' must accept \*\*kwargs"):
        register_segmenter("no_kwargs_test", lambda *, mask: mask)
    with pytest.raises(TypeError, match=r"requires \['window'\], which it is never given.*functools.partial"):
        register_advantage_estimator("needs_window_test", lambda *, rewards, window, **_: None)
    with pytest.raises(ValueError, match="min_generations"):
        register_advantage_estimator("zero_groups_test", lambda **_: None, min_generations=0)
    assert not {"no_kwargs_test", "needs_window_test", "zero_groups_test"} & (
        set(SEGMENTERS) | set(ADVANTAGE_ESTIMATORS)
    )


def test_partial_binds_extra_settings_and_bad_outputs_name_the_segmenter(unregister):
    def every_k(*, mask, k, **_):
        return (torch.arange(mask.shape[1]) % k == 0).expand_as(mask)

    register_segmenter("every_3_test", functools.partial(every_k, k=3))
    register_segmenter("wrong_shape_test", lambda *, mask, **_: mask[:, :1])
    unregister(SEGMENTERS, "every_3_test")
    unregister(SEGMENTERS, "wrong_shape_test")
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    assert get_segmenter_spec("every_3_test")(mask=mask).nonzero().tolist() == [
        [0, 0],
        [0, 3],
        [0, 6],
        [1, 0],
        [1, 3],
    ]
    with pytest.raises(ValueError, match=r"segmenter 'wrong_shape_test' returned \(2, 1\).*\(2, 7\)"):
        get_segmenter_spec("wrong_shape_test")(mask=mask)
