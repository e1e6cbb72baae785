"""examples/real_model/smollm2_135m_chain_pretrained_critic.yaml: the recipe that pretrains the critic (issue 50
item 4) has the registered comparison's SAE-arm settings and the measured fit's value-pretraining settings, and
runs end to end through ``trl-sae train`` on the tiny model (pretraining, then PPO), and a copy of it that loads
the pretrained critic instead, as its header says, samples nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.recipe import load_recipe_datasets, parse_recipe, run_recipe
from trl_sae.trainer.parts import value_pretrain

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "real_model" / "smollm2_135m_chain_pretrained_critic.yaml"
REGISTRATION = ROOT / "benchmarks" / "experiments" / "sae-pretrained-critic.md"


def registered_task_config() -> dict:
    """The task settings the comparison was registered with (its CFG='...' line)."""
    match = re.search(r"CFG='(\{.*?\})'", REGISTRATION.read_text())
    assert match, "the registration names its task settings as CFG='{...}'"
    return json.loads(match.group(1))


def test_the_recipe_has_the_registered_sae_arm_settings_and_the_measured_fit():
    pytest.importorskip("reasoning_gym")
    script_args, config = parse_recipe([str(RECIPE)])
    assert json.loads(script_args.reasoning_gym_config) == registered_task_config()
    assert script_args.reasoning_gym_few_shot == 2 and script_args.reasoning_gym_worked_steps
    assert script_args.value_model_name_or_path == "shared" and script_args.use_peft
    assert script_args.lora_layers_to_transform == list(range(20, 30))  # the last 10 of SmolLM2's 30
    # the registered arms: 4 prompts x 8, one optimizer step a rollout, lr 3e-4 (critic too), 64 tokens, 24 steps
    assert config.num_generations == 8
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 32
    assert (config.num_ppo_epochs, config.num_mini_batches, config.max_steps) == (1, 1, 24)
    assert (
        config.learning_rate == config.critic_learning_rate == 3e-4 and config.lr_scheduler_type == "constant"
    )
    assert (config.response_length, config.kl_coef, config.temperature) == (64, 0.0, 1.0)
    assert (config.advantage_estimator, config.lam, config.segment_threshold) == ("sae", 0.95, 0.2)
    # the fit benchmarks/experiments/critic-pretraining.md measured: shared-base, lr 5e-4, 512 rollouts
    assert (config.value_pretrain_rollouts, config.value_pretrain_held_out) == (512, 256)
    assert config.value_pretrain_learning_rate == 5e-4 and config.value_pretrain_patience == 1
    train, held_out = load_recipe_datasets(script_args, seed=config.seed)
    assert len(train) == 640 and not set(train["question"]) & set(held_out["question"])
    example = train[0]["prompt"][1]["content"]  # a solved example: two additions, one a line
    assert len(example.split("\n")) == 3


def test_the_recipe_pretrains_the_critic_then_trains_on_the_tiny_model(tmp_path, tokenizer, monkeypatch):
    pytest.importorskip("reasoning_gym")
    model_dir = tmp_path / "tiny"
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    shrink = [
        "--model_name_or_path", str(model_dir),
        "--max_train_samples", "8", "--max_eval_samples", "6", "--max_steps", "1", "--eval_on_start", "false",
        "--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--response_length", "8", "--lora_layers_to_transform", "0", "1",
        "--log_completions", "false", "--merge_adapters", "false",
    ]  # fmt: skip
    pretrain = [
        "--value_pretrain_rollouts", "8", "--value_pretrain_held_out", "4", "--value_pretrain_epochs", "2",
    ]  # fmt: skip
    script_args, config = parse_recipe([str(RECIPE), "--output_dir", str(out), *shrink, *pretrain])
    summary = run_recipe(script_args, config)
    pretrained = json.loads((out / "value_pretrain" / "value_pretrain.json").read_text())
    assert pretrained["rollouts"] == {"fit": 8, "held_out": 4, "processes": 1}
    assert 1 <= pretrained["epochs_run"] <= 2 and len(pretrained["explained_variance_held_out"]) >= 2
    assert pretrained["settings"]["value_pretrain_learning_rate"] == 5e-4
    assert summary["train_prompts"] == 8

    # The recipe's second use: a copy of it whose value-pretraining block is replaced by the first run's critic
    # (as its header says) loads that critic and samples nothing.
    lines = RECIPE.read_text().splitlines()
    kept = [line for line in lines if not line.startswith("value_pretrain_")]
    assert len(lines) - len(kept) == 5  # the block: rollouts, held out, epochs, patience, learning rate
    copy = tmp_path / "from_pretrained.yaml"
    copy.write_text("\n".join([*kept, f"value_pretrain_path: {out / 'value_pretrain'}"]) + "\n")
    loaded = []

    def load(trainer, path):
        loaded.append(Path(path))
        return original_load(trainer, path)

    def no_sampling(self, resume=False):
        raise AssertionError("a run from a pretrained critic sampled pretraining rollouts")

    original_load = value_pretrain.load_pretrained_critic
    monkeypatch.setattr(value_pretrain, "load_pretrained_critic", load)
    monkeypatch.setattr(value_pretrain.ValuePretraining, "rollouts", no_sampling)
    second = tmp_path / "second"
    script_args, config = parse_recipe([str(copy), "--output_dir", str(second), *shrink])
    assert (config.value_pretrain_rollouts, config.value_pretrain_path) == (0, str(out / "value_pretrain"))
    run_recipe(script_args, config)
    assert loaded == [out / "value_pretrain"]
    assert sorted(p.name for p in second.iterdir()) == sorted(
        p.name for p in out.iterdir() if p.name != "value_pretrain"
    )
