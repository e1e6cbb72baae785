"""The trainer under bad rewards: a reward function that hangs, no reward at all, and rewards that overflow."""

from __future__ import annotations

import json
import textwrap
import threading
import warnings

import pytest
import torch

from trl_sae.rewards.protocol import RewardTimeoutError

from .test_distributed import launch_two_ranks
from .test_trainer import make_config, make_trainer, parameters_of, vowel_fraction


def all_weights(trainer) -> dict[str, torch.Tensor]:
    return parameters_of(trainer.accelerator.unwrap_model(trainer.model))


# --------------------------------------------------------------------------------------------------
# reward_timeout
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "300"])
def test_reward_timeout_must_be_positive_and_finite(tmp_path, value):
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.reward_timeout: must be (a positive number|finite)"):
        make_config(tmp_path, reward_timeout=value)


def test_reward_function_that_never_returns_stops_training(tmp_path, tokenizer):
    release = threading.Event()

    def stuck_reward(prompts, completions, completion_ids, **kwargs):
        release.wait()  # never set while the trainer waits: a hung reward server, a deadlock, ...
        return [0.0] * len(completions)

    trainer = make_trainer(
        tmp_path, tokenizer, reward_funcs=[vowel_fraction, stuck_reward], reward_timeout=0.5, max_steps=1
    )
    before = all_weights(trainer)
    try:
        with pytest.raises(RewardTimeoutError) as info:
            trainer.train()  # raising at all, with the reward still blocked, is the "not forever"
    finally:
        release.set()  # let the abandoned daemon thread finish
    message = str(info.value)
    assert "reward function 'stuck_reward'" in message and "reward_timeout=0.5s" in message
    assert "abandoned" in message and "daemon thread" in message
    assert isinstance(info.value, TimeoutError)
    after = all_weights(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_reward_timeout_leaves_fast_functions_alone(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, reward_timeout=30.0, max_steps=1)
    trainer.train()
    rewards = [log["reward/vowel_fraction/mean"] for log in trainer.state.log_history if "reward/mean" in log]
    assert len(rewards) == 1 and 0.0 <= rewards[0] <= 1.0


# --------------------------------------------------------------------------------------------------
# Training on zero reward.
# --------------------------------------------------------------------------------------------------
def test_empty_reward_funcs_warns_that_the_run_trains_on_zero_reward(tmp_path, tokenizer):
    with pytest.warns(RuntimeWarning, match="Training on zero reward: `reward_funcs` is empty") as record:
        trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[], max_steps=2)
        trainer.train()
    assert sum("zero reward" in str(w.message) for w in record) == 1  # once, not every step
    assert all(log["reward/mean"] == 0.0 for log in trainer.state.log_history if "reward/mean" in log)


def test_reward_functions_returning_none_for_a_whole_step_warn_once(tmp_path, tokenizer, caplog):
    def first_only(prompts, completions, completion_ids, **kwargs):
        return [1.0] + [None] * (len(completions) - 1)

    def not_applicable(prompts, completions, completion_ids, **kwargs):
        return [None] * len(completions)

    with warnings.catch_warnings():  # one applicable score is a signal: no warning
        warnings.filterwarnings("error", message=".*zero reward.*")
        make_trainer(tmp_path, tokenizer, reward_funcs=[first_only, not_applicable], max_steps=1).train()

    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[not_applicable], max_steps=2)
    with (
        pytest.warns(RuntimeWarning) as record,
        caplog.at_level("WARNING", logger="trl_sae.rewards.protocol"),
    ):
        trainer.train()
    messages = [str(w.message) for w in record if "zero reward" in str(w.message)]
    assert len(messages) == 1, messages
    assert (
        "every reward function (not_applicable) returned None for every completion at step 1" in messages[0]
    )
    assert sum("Training on zero reward" in r.getMessage() for r in caplog.records) == 1


# --------------------------------------------------------------------------------------------------
# Non-finite losses.
# --------------------------------------------------------------------------------------------------
def huge_reward(prompts, completions, completion_ids, **kwargs):
    return [1e30] * len(completions)


def test_huge_reward_stops_before_the_optimizer_step(tmp_path, tokenizer):
    # One mini-batch of the whole step: the first loss is the one that would have moved the weights.
    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[huge_reward], max_steps=2)
    before = all_weights(trainer)
    with pytest.raises(FloatingPointError) as info:
        trainer.train()
    message = str(info.value)
    assert "non-finite loss/value" in message and "at step 1 " in message
    assert "loss/value=inf" in message and "[1e+30, 1e+30]" in message
    after = all_weights(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert trainer.state.global_step == 0


def test_nan_from_the_model_stops_before_the_optimizer_step(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, advantage_estimator="grpo", max_steps=1)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    # A NaN that appears only in the training forward pass (after the rollout), as an fp16 overflow would.
    handle = policy.model.norm.register_forward_hook(
        lambda module, inputs, output: output * float("nan") if module.training else output
    )
    before = all_weights(trainer)
    try:
        with pytest.raises(FloatingPointError, match=r"non-finite loss/policy at step 1 \(loss/policy=nan"):
            trainer.train()
    finally:
        handle.remove()
    after = all_weights(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_reward_too_large_for_float32_is_rejected_at_scoring(tmp_path, tokenizer):
    def overflowing(prompts, completions, completion_ids, **kwargs):
        return [1e39] * len(completions)

    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[overflowing], max_steps=1)
    with pytest.raises(
        ValueError, match="reward function 'overflowing' returned 1e\\+39 at index 0, which overflows"
    ):
        trainer.train()


# --------------------------------------------------------------------------------------------------
# Several processes: a failure on one rank stops every rank (none waits forever in a collective).
# --------------------------------------------------------------------------------------------------
TWO_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    rank = int(os.environ["RANK"])
    release = threading.Event()

    def stuck_on_rank_1(prompts, completions, completion_ids, **columns):
        if rank == 1:
            release.wait()
        return [0.5] * len(completions)

    def huge_on_rank_1(prompts, completions, completion_ids, **columns):
        return [1e30 if rank == 1 else 0.5] * len(completions)

    tokenizer = build_char_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]})
    outcomes = {}
    for case, func, extra in [("timeout", stuck_on_rank_1, {"reward_timeout": 2.0}), ("nonfinite", huge_on_rank_1, {})]:
        config = SAEPPOConfig(
            output_dir=sys.argv[1], per_device_train_batch_size=4, num_generations=2, response_length=6,
            max_steps=2, learning_rate=1e-3, critic_learning_rate=1e-3, temperature=1.0, report_to="none",
            disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, stop_token=None, **extra,
        )
        trainer = SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=func, args=config,
            train_dataset=dataset, processing_class=tokenizer,
        )
        try:
            trainer.train()
            outcomes[case] = "finished"
        except Exception as error:
            outcomes[case] = f"{type(error).__name__}: {error}"
    release.set()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump(outcomes, handle)
    """
)


@pytest.mark.slow  # two processes under accelerate launch, two trainers each: ~40 s on 2 cores
@pytest.mark.timeout(600)
def test_a_failure_on_one_rank_stops_every_rank(tmp_path):
    # Without the agreement between ranks, rank 0 would wait in the next collective for gloo's 30 minutes. The
    # script leaves with os._exit: tearing down a process group that holds aborted work is not what it tests.
    launch_two_ranks(
        tmp_path / "two_ranks.py", TWO_RANK_SCRIPT, str(tmp_path), timeout=300, end_process_group=False
    )
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank1["timeout"].startswith("RewardTimeoutError: reward function 'stuck_on_rank_1'")
    assert rank0["timeout"].startswith(
        "RuntimeError: 1 other process(es) failed while scoring rewards at step 1"
    )
    for outcome in (rank0["nonfinite"], rank1["nonfinite"]):
        assert outcome.startswith("FloatingPointError: non-finite loss/value at step 1"), outcome
