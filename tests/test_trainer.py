"""SAEPPOTrainer on a tiny Qwen3: every estimator and segmenter runs, it learns, it checkpoints exactly."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.trainer.critics.build import build_critic_from_policy

VOWELS = set("aeiou")

LOGGED_KEYS = {
    "reward/mean",
    "reward/std",
    "reward/vowel_fraction/mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "segments/boundaries_per_completion",
    "segments/mean_length",
    "advantages/mean",
    "advantages/std",
    "values/mean",
    "critic/explained_variance",
    "loss/policy",
    "loss/value",
    "policy/clipfrac",
    "policy/approx_kl",
    "policy/entropy",
    "timing/rollout_s",
    "timing/update_s",
}


def vowel_fraction(prompts, completions, completion_ids, **columns):
    """Learnable dense-ish reward: the share of vowels in the completion."""
    return [sum(ch in VOWELS for ch in text) / max(len(text), 1) for text in completions]


def make_dataset(n: int = 16, chat: bool = False) -> Dataset:
    prompts = [f"Say vowels {i}:" for i in range(n)]
    if chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict({"prompt": prompts, "answer": [str(i) for i in range(n)]})


def make_config(tmp_path, **overrides) -> SAEPPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        response_length=8,
        max_steps=2,
        learning_rate=3e-3,
        critic_learning_rate=3e-3,
        temperature=1.0,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        stop_token=None,
    )
    settings.update(overrides)
    return SAEPPOConfig(**settings)


def make_trainer(tmp_path, tokenizer, model=None, reward_funcs=vowel_fraction, dataset=None, **overrides):
    return SAEPPOTrainer(
        model=model if model is not None else build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=reward_funcs,
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else make_dataset(),
        processing_class=tokenizer,
    )


def parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("estimator", ["sae", "gae", "mc", "adaptive_lambda", "grpo"])
def test_every_estimator_runs_and_logs_the_documented_keys(tmp_path, tokenizer, estimator):
    trainer = make_trainer(tmp_path, tokenizer, advantage_estimator=estimator, max_steps=1)
    before = parameters_of(trainer.accelerator.unwrap_model(trainer.model).policy)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    assert len(logs) == 1
    critic_keys = {"loss/value", "values/mean", "critic/explained_variance"}
    expected = LOGGED_KEYS if estimator != "grpo" else LOGGED_KEYS - critic_keys
    assert expected <= set(logs[0]), expected - set(logs[0])
    if estimator == "grpo":  # no critic: nothing that would read as a critic explaining nothing
        assert not critic_keys & set(logs[0]), critic_keys & set(logs[0])
    assert all(math.isfinite(logs[0][key]) for key in expected)
    after = parameters_of(trainer.accelerator.unwrap_model(trainer.model).policy)
    assert any(not torch.equal(before[name], after[name]) for name in before), "the policy did not move"
    assert (trainer.value_model is None) == (estimator == "grpo")


@pytest.mark.parametrize("segmentation", ["probability", "uniform", "newline", "entropy"])
def test_every_segmenter_runs(tmp_path, tokenizer, segmentation):
    trainer = make_trainer(
        tmp_path, tokenizer, segmentation=segmentation, segment_length=3, entropy_threshold=4.0, max_steps=1
    )
    trainer.train()
    log = trainer.state.log_history[-1]
    assert 0 <= log["segments/boundaries_per_completion"] <= 8
    if segmentation == "uniform":
        # positions 3 and 6 of 8 tokens open segments
        assert log["segments/boundaries_per_completion"] == pytest.approx(2.0)


def test_chat_prompts_and_tokenized_input_ids_are_accepted(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, dataset=make_dataset(chat=True), max_steps=1)
    first = trainer.train_dataset[0]["input_ids"]
    assert tokenizer.decode(first).startswith("<|im_start|>user\nSay vowels")
    assert tokenizer.decode(first).endswith("<|im_start|>assistant\n")
    trainer.train()
    ids = [tokenizer(f"Say vowels {i}:")["input_ids"] for i in range(16)]
    trainer = make_trainer(tmp_path, tokenizer, dataset=Dataset.from_dict({"input_ids": ids}), max_steps=1)
    trainer.train()


def test_reward_columns_reach_the_reward_functions(tmp_path, tokenizer):
    seen = {}

    def answer_reward(prompts, completions, completion_ids, answer, **columns):
        seen["answer"] = list(answer)
        seen["prompts"] = list(prompts)
        assert len(completion_ids) == len(completions) == len(answer)
        return [1.0 if a == "0" else None for a in answer]

    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[answer_reward, vowel_fraction], max_steps=1)
    trainer.train()
    # each prompt's row is repeated num_generations times, aligned with its completions
    assert seen["answer"][0::4] == [p.split()[-1].rstrip(":") for p in seen["prompts"][0::4]]
    assert seen["answer"][0:4] == [seen["answer"][0]] * 4
    assert "reward/answer_reward/mean" in trainer.state.log_history[-1]


# 30 steps on the vowel reward that raise it by > 0.25 (the learning tests here and in tests/test_vllm.py).
LEARNING_RUN = dict(
    max_steps=30,
    per_device_train_batch_size=16,
    num_generations=4,
    num_ppo_epochs=2,
    learning_rate=1e-2,
    critic_learning_rate=1e-2,
    response_length=6,
)


def assert_reward_rose(trainer, by: float = 0.25) -> None:
    """The mean reward of the last 5 logged steps beats the first 5 by more than ``by``."""
    rewards = [entry["reward/mean"] for entry in trainer.state.log_history if "reward/mean" in entry]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + by, (first, last)


def test_ppo_with_sae_raises_the_reward(tmp_path, tokenizer):
    """A few dozen steps on a learnable reward: the trainer learns, it does not merely run."""
    trainer = make_trainer(tmp_path, tokenizer, **LEARNING_RUN)
    trainer.train()
    assert_reward_rose(trainer)


def test_gae_parity_with_a_reverse_loop_on_a_captured_batch(tmp_path, tokenizer):
    captured = {}

    class Capturing(SAEPPOTrainer):
        def _compute_advantages(self, batch):
            super()._compute_advantages(batch)
            captured["batch"] = batch

    trainer = Capturing(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=vowel_fraction,
        args=make_config(
            tmp_path, advantage_estimator="gae", lam=0.9, gamma=0.99, max_steps=1, stop_token="eos"
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
    )
    trainer.train()
    batch = captured["batch"]
    expected = torch.zeros_like(batch.raw_advantages)
    for i in range(batch.completion_ids.shape[0]):
        length = int(batch.lengths[i])
        running = 0.0
        for t in reversed(range(length)):
            next_value = batch.values[i, t + 1] if t + 1 < length else 0.0
            delta = batch.token_rewards[i, t] + 0.99 * next_value - batch.values[i, t]
            running = delta + 0.99 * 0.9 * running
            expected[i, t] = running
        assert batch.token_rewards[i, length - 1] == pytest.approx(float(batch.scores[i]))
    torch.testing.assert_close(batch.raw_advantages, expected, atol=1e-5, rtol=1e-5)
    # the critic trains on GAE(critic_lam=1) returns: reward-to-go on every valid token
    valid = batch.mask
    reward_to_go = batch.scores.unsqueeze(1) * (
        0.99 ** (batch.lengths.unsqueeze(1) - 1 - torch.arange(valid.shape[1]))
    )
    torch.testing.assert_close(batch.returns[valid], reward_to_go[valid].float(), atol=1e-5, rtol=1e-5)


def test_kl_zero_skips_the_reference_pass_and_kl_positive_uses_it(tmp_path, tokenizer, monkeypatch):
    calls = []
    trainer = make_trainer(tmp_path, tokenizer, max_steps=1)
    monkeypatch.setattr(trainer, "_reference_logprobs", lambda batch: calls.append(1))
    trainer.train()
    assert trainer.ref_model is None and calls == []
    trainer = make_trainer(tmp_path, tokenizer, max_steps=1, kl_coef=0.1)
    assert trainer.ref_model is not None
    trainer.train()
    assert "reward/mean" in trainer.state.log_history[-1]


def test_value_warmup_moves_only_the_critic(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, max_steps=1, value_warmup_steps=1)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    policy_before, critic_before = parameters_of(unwrapped.policy), parameters_of(unwrapped.critic)
    trainer.train()
    assert all(torch.equal(policy_before[n], p) for n, p in parameters_of(unwrapped.policy).items())
    assert any(not torch.equal(critic_before[n], p) for n, p in parameters_of(unwrapped.critic).items())
    assert "loss/policy" not in trainer.state.log_history[-1]


def test_critic_built_from_policy_starts_from_its_backbone_with_a_zero_head(tiny_model):
    critic = build_critic_from_policy(tiny_model)
    policy_backbone = tiny_model.model.state_dict()
    assert critic.model.state_dict().keys() == policy_backbone.keys()
    assert all(torch.equal(value, policy_backbone[key]) for key, value in critic.model.state_dict().items())
    assert torch.count_nonzero(critic.score.weight) == 0 and critic.score.weight.shape[0] == 1


class _FakeZero3:
    """DeepSpeed ZeRO-3 as :func:`build_critic_from_policy` meets it, without DeepSpeed: a partitioned
    parameter holds a size-0 tensor with its full shape in ``ds_shape``, and ``zero.GatheredParameters``
    puts the full tensor back inside the context (recording what it gathered and ``modifier_rank``)."""

    def __init__(self):
        self.gathers = []  # (ids of the partitioned parameters gathered, modifier_rank)
        self.next_id = 0
        fake = self

        class GatheredParameters:
            def __init__(self, params, modifier_rank=None):
                # like DeepSpeed: anything that is not a partitioned parameter (buffers, plain weights) is left
                self.params = list({id(p): p for p in params if hasattr(p, "ds_id")}.values())
                fake.gathers.append(({id(p) for p in self.params}, modifier_rank))

            def __enter__(self):
                for parameter in self.params:
                    parameter.data = parameter.ds_full

            def __exit__(self, *exc):
                for parameter in self.params:
                    fake.hide(parameter)

        self.zero = type("zero", (), {"GatheredParameters": GatheredParameters})

    def hide(self, parameter):
        parameter.ds_full = parameter.data
        parameter.data = torch.empty(0, dtype=parameter.dtype)

    def partition(self, module):
        for parameter in module.parameters():
            parameter.ds_id, parameter.ds_shape = self.next_id, parameter.shape
            self.next_id += 1
            self.hide(parameter)
        return module

    def full(self, module):
        """``module``'s state dict with every parameter gathered."""
        return {
            key: getattr(value, "ds_full", value).detach().clone()
            for key, value in module.state_dict(keep_vars=True).items()
        }


@pytest.mark.parametrize("partitioned_policy", [True, False], ids=["policy-from-path", "policy-built-before"])
def test_critic_built_from_policy_under_zero3_copies_inside_gathers(
    tokenizer, monkeypatch, partitioned_policy
):
    """Under ZeRO-3 with zero3_init_flag the critic's parameters (and a policy loaded from a path) are
    partitioned, so a plain load_state_dict copied nothing (or failed on sizes): the copy and the zeroing
    must happen on gathered parameters, with rank 0's values kept (modifier_rank=0)."""
    import sys
    import types

    from trl_sae.trainer.critics import build as models

    fake = _FakeZero3()
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(zero=fake.zero))
    monkeypatch.setattr(models, "is_deepspeed_zero3_enabled", lambda: True)
    from_config = models.AutoModelForSequenceClassification.from_config
    # transformers builds it inside deepspeed.zero.Init: partitioned from the start
    monkeypatch.setattr(
        models.AutoModelForSequenceClassification,
        "from_config",
        lambda *args, **kwargs: fake.partition(from_config(*args, **kwargs)),
    )
    policy = build_tiny_qwen3(tokenizer, seed=0)
    expected = {key: value.clone() for key, value in policy.model.state_dict().items()}
    if partitioned_policy:
        fake.partition(policy)

    critic = build_critic_from_policy(policy)

    assert all(parameter.numel() == 0 for parameter in critic.parameters())  # partitioned again on exit
    gathered = set().union(*(ids for ids, _ in fake.gathers))
    assert {id(parameter) for parameter in critic.parameters()} <= gathered
    if partitioned_policy:
        assert {id(parameter) for parameter in policy.model.parameters()} <= gathered
    assert {rank for _, rank in fake.gathers} == {0}
    copied = fake.full(critic.model)
    assert copied.keys() == expected.keys()
    assert all(torch.equal(value, expected[key]) for key, value in copied.items())
    assert fake.full(critic)["score.weight"].shape == (1, policy.config.hidden_size)
    assert torch.count_nonzero(fake.full(critic)["score.weight"]) == 0


def test_separate_learning_rates_for_actor_and_critic(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, learning_rate=1e-6, critic_learning_rate=1e-5)
    rates = sorted({group["lr"] for group in trainer.optimizer.param_groups})
    assert rates == pytest.approx([1e-6, 1e-5])


class StopAfter(TrainerCallback):
    """Simulates a crash: training stops after `step` steps although it was configured for more."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def _run(tmp_path, tokenizer, name, max_steps, resume=None, stop_after=None, **overrides):
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(
            tmp_path,
            output_dir=str(tmp_path / name),
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=2,
            **overrides,
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        callbacks=[StopAfter(stop_after)] if stop_after else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_resume_continues_exactly_where_it_stopped(tmp_path, tokenizer):
    straight = _run(tmp_path, tokenizer, "straight", max_steps=4)
    stopped = _run(tmp_path, tokenizer, "interrupted", max_steps=4, stop_after=2)
    assert stopped.state.global_step == 2
    checkpoint = tmp_path / "interrupted" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "value_model").is_dir()
    resumed = _run(tmp_path, tokenizer, "interrupted", max_steps=4, resume=str(checkpoint))
    assert resumed.state.global_step == 4
    a = parameters_of(straight.accelerator.unwrap_model(straight.model))
    b = parameters_of(resumed.accelerator.unwrap_model(resumed.model))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)
    rewards_a = [e["reward/mean"] for e in straight.state.log_history if "reward/mean" in e]
    rewards_b = [e["reward/mean"] for e in resumed.state.log_history if "reward/mean" in e]
    assert rewards_a == pytest.approx(rewards_b)


def test_an_interrupted_save_keeps_the_previous_checkpoint(tmp_path, tokenizer, monkeypatch):
    trainer = _run(tmp_path, tokenizer, "crash", max_steps=2)
    good = tmp_path / "crash" / "checkpoint-2"
    files_before = sorted(p.relative_to(good) for p in good.rglob("*"))
    trainer.state.global_step = 2  # a re-save of the same step must not destroy it either

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(trainer.accelerator, "save_state", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        trainer._save_checkpoint(trainer.model)
    assert sorted(p.relative_to(good) for p in good.rglob("*")) == files_before
    resumed = _run(tmp_path, tokenizer, "crash", max_steps=3, resume=True)
    assert resumed.state.global_step == 3


def test_save_model_writes_policy_and_critic(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    trainer = make_trainer(tmp_path, tokenizer, max_steps=1)
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    policy = AutoModelForCausalLM.from_pretrained(out)
    critic = AutoModelForSequenceClassification.from_pretrained(out / "value_model")
    trained = trainer.accelerator.unwrap_model(trainer.model)
    torch.testing.assert_close(policy.lm_head.weight, trained.policy.lm_head.weight)
    torch.testing.assert_close(critic.score.weight, trained.critic.score.weight)
    assert os.path.exists(out / "tokenizer_config.json")


# ---------------------------------------------------------------------------------------------------
# Bad input: clear errors raised early, naming the argument.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"segment_threshold": 0.0}, "segment_threshold"),
        ({"segment_threshold": 1.2}, "segment_threshold"),
        ({"lam": 1.5}, "lam"),
        ({"critic_lam": -0.1}, "critic_lam"),
        ({"gamma": 2.0}, "gamma"),
        ({"per_device_train_batch_size": 6, "num_generations": 4}, "per_device_train_batch_size"),
        ({"advantage_estimator": "vtrace"}, "advantage_estimator"),
        ({"segmentation": "sentences"}, "segmentation"),
        ({"segment_length": 0}, "segment_length"),
        ({"entropy_threshold": 0.0}, "entropy_threshold"),
        ({"num_generations": 0}, "num_generations"),
        (
            {"advantage_estimator": "grpo", "num_generations": 1, "per_device_train_batch_size": 8},
            "num_generations",
        ),
        ({"advantage_estimator": "grpo", "kl_coef": 0.1}, "kl_coef"),
        ({"advantage_estimator": "grpo", "value_warmup_steps": 2}, "value_warmup_steps"),
        ({"temperature": 0.0}, "temperature"),
        ({"num_mini_batches": 3}, "num_mini_batches"),
        ({"loss_agg_mode": "seq-mean"}, "loss_agg_mode"),
        ({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch"),
    ],
)
def test_invalid_config_fails_in_post_init_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        make_config(tmp_path, **overrides)


def test_bad_datasets_fail_early(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="`prompt` column"):
        make_trainer(tmp_path, tokenizer, dataset=Dataset.from_dict({"question": ["a", "b"]}))
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tmp_path, tokenizer, dataset=Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="train_dataset"):
        make_trainer(tmp_path, tokenizer, dataset=make_dataset(n=1))


@pytest.mark.parametrize(
    ("bad_output", "message"),
    [
        (lambda n: [0.0] * (n - 1), "returned"),
        (lambda n: [float("nan")] * n, "NaN|nan|finite"),
        (lambda n: [float("inf")] * n, "inf|finite"),
    ],
)
def test_bad_reward_outputs_name_the_function(tmp_path, tokenizer, bad_output, message):
    def broken_reward(prompts, completions, completion_ids, **columns):
        return bad_output(len(completions))

    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[vowel_fraction, broken_reward], max_steps=1)
    with pytest.raises(ValueError, match="broken_reward") as error:
        trainer.train()
    assert re.search(message, str(error.value))


def test_missing_rewards_and_bad_model_arguments(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="reward_funcs"):
        make_trainer(tmp_path, tokenizer, reward_funcs=None)
    with pytest.raises(ValueError, match="reward_weights"):
        make_trainer(tmp_path, tokenizer, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="model_init_kwargs"):
        make_trainer(tmp_path, tokenizer, model_init_kwargs={"dtype": "float32"})
    with pytest.raises(TypeError, match="model"):
        make_trainer(tmp_path, tokenizer, model=42)
    with pytest.raises(ValueError, match="value_model"):
        SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer),
            reward_funcs=vowel_fraction,
            args=make_config(tmp_path, advantage_estimator="grpo"),
            train_dataset=make_dataset(),
            processing_class=tokenizer,
            value_model=build_tiny_qwen3(tokenizer),
        )


def test_log_completions_marks_segment_boundaries(tmp_path, tokenizer, capsys):
    trainer = make_trainer(
        tmp_path, tokenizer, max_steps=1, log_completions=True, segmentation="uniform", segment_length=3
    )
    trainer.train()
    rows = trainer._last_completions
    assert len(rows) == 8
    for row in rows:
        # uniform M=3 over 8 tokens: boundaries before tokens 3 and 6
        assert row["completion_with_boundaries"].count("|") == 2, row
        assert len(row["completion_with_boundaries"].split("|")[0]) <= 3
    assert "segment boundary" in capsys.readouterr().out


def test_evaluate_reports_the_mean_reward_of_eval_prompts(tmp_path, tokenizer):
    def constant(prompts, completions, completion_ids, **columns):
        return [0.25] * len(completions)

    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=constant,
        args=make_config(tmp_path, per_device_eval_batch_size=3),
        train_dataset=make_dataset(),
        eval_dataset=make_dataset(n=5),
        processing_class=tokenizer,
    )
    assert trainer.evaluate() == {"eval/reward/mean": pytest.approx(0.25), "eval/accuracy": 0.0}
    assert trainer.args.num_generations == 4  # restored after the one-sample evaluation


def test_greedy_evaluation_is_the_greedy_accuracy_of_plain_generate(tmp_path, tokenizer, capsys):
    """Issue 31: eval_temperature=0 evaluates greedily (the accuracy of docs/guides/real-model.md), whatever the training
    temperature; the result equals trl_sae.evaluation's model.generate greedy completions scored alike, and a
    progress bar counts the prompts (issue 29: 31 minutes of evaluation showed nothing)."""
    from trl_sae.evaluation import generate_completions

    # Prompts ending in different characters: the untrained model's greedy completion repeats the last one.
    eval_set = Dataset.from_dict({"prompt": [f"Say {c}" for c in "aexoz"], "answer": list("01234")})
    greedy_texts, _ = generate_completions(
        build_tiny_qwen3(tokenizer), tokenizer, list(eval_set["prompt"]), max_new_tokens=8
    )
    # "Correct": the greedy completion of prompts 0, 2 and 4 (a sampled one would rarely match all three).
    target = {
        prompt: text for i, (prompt, text) in enumerate(zip(eval_set["prompt"], greedy_texts)) if i % 2 == 0
    }
    assert len(set(greedy_texts)) > 1 and all(len(text) > 2 for text in greedy_texts)

    def right_on_target(prompts, completions, completion_ids, **columns):
        return [float(target.get(prompt) == text) for prompt, text in zip(prompts, completions, strict=True)]

    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=right_on_target,
        args=make_config(
            tmp_path, per_device_eval_batch_size=2, eval_temperature=0.0, stop_token="eos", disable_tqdm=False
        ),
        train_dataset=make_dataset(),
        eval_dataset=eval_set,
        processing_class=tokenizer,
    )
    capsys.readouterr()
    assert trainer.evaluate() == {"eval/reward/mean": pytest.approx(0.6), "eval/accuracy": 0.6}
    progress = capsys.readouterr().err
    assert "evaluate (prompts):   0%|          | 0/5 [" in progress
    trainer.args.disable_tqdm = True
    assert trainer.evaluate()["eval/accuracy"] == 0.6  # greedy: the same again
    assert "evaluate (prompts)" not in capsys.readouterr().err
    sampling = trainer.rollouts.generation_config  # the rollout part's, restored after evaluating
    assert sampling is trainer.generation_config
    assert sampling.do_sample and sampling.temperature == 1.0


def test_a_run_that_evaluated_ends_with_one_before_after_line():
    from trl_sae.trainer.parts.evaluation import held_out_line

    history = [
        {"eval/reward/mean": 0.25, "eval/accuracy": 0.37, "step": 0},
        {"loss/policy": 0.1, "step": 1},
        {"eval/reward/mean": 0.5, "eval/accuracy": 0.49, "step": 12},
    ]
    assert held_out_line(history, 0.0) == (
        "held-out (greedy), step 0 -> 12: accuracy 0.37 -> 0.49; mean reward 0.25 -> 0.5"
    )
    assert held_out_line(history[2:], 1.0) == (
        "held-out (one sample at temperature 1) after step 12: accuracy 0.49; mean reward 0.5 (eval_on_start "
        "adds the value before training)"
    )
    assert held_out_line(history[1:2], 0.0) is None
