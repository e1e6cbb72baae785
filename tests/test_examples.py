"""examples/: every recipe parses and builds a trainer (on a tiny local model), baselines differ only in the
estimator, the accelerate configs are valid, and the example script runs through accelerate's entry point."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from trl_sae import SAEPPOConfig
from trl_sae.cli.app import main
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.recipe import ScriptArguments, parse_recipe, run_recipe

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECIPES = sorted(EXAMPLES.glob("*.yaml")) + sorted((EXAMPLES / "baselines").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((EXAMPLES / "accelerate_configs").glob("*.yaml"))
# Recipes that sample with vLLM (sleep mode, a server) cannot build on a CPU as written; tests/test_vllm.py
# trains the colocated one on CPU with sleep mode off and checks the server one is refused there.
VLLM_RECIPES = [p for p in RECIPES if yaml.safe_load(p.read_text()).get("use_vllm")]


def recipe_id(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-policy")
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def math_jsonl(tmp_path_factory):
    # 80 problems: the paper recipe samples 64 prompts per step on one process.
    path = tmp_path_factory.mktemp("math") / "problems.jsonl"
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(80)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def offline_overrides(tmp_path: Path, tiny_dir: Path, math_jsonl: Path) -> list[str]:
    """Swap the Hub model and datasets for local ones and the GPU settings for CPU ones."""
    return [
        "--model_name_or_path",
        str(tiny_dir),
        "--dataset_name",
        str(math_jsonl),
        "--eval_dataset_name",
        str(math_jsonl),
        "--output_dir",
        str(tmp_path / "out"),
        "--bf16",
        "false",
        "--use_cpu",
        "true",
    ]


def test_the_examples_exist():
    names = {recipe_id(p) for p in RECIPES}
    assert {
        "qwen3_0.6b_qlora.yaml",
        "qwen3_1.7b_lora.yaml",
        "qwen3_4b_lora.yaml",
        "paper_qwen3_8b_base.yaml",
        "baselines/gae.yaml",
        "baselines/mc.yaml",
        "baselines/adaptive_lambda.yaml",
        "baselines/grpo.yaml",
        "qwen3_0.6b_qlora_vllm.yaml",
        "qwen3_1.7b_lora_vllm.yaml",
        "dapo_style_sae.yaml",
        "qwen3_4b_base_stem.yaml",
        "qwen3_4b_instruct_code.yaml",
    } <= names
    assert {p.name for p in ACCELERATE_CONFIGS} == {
        "single_gpu.yaml",
        "multi_gpu.yaml",
        "fsdp2.yaml",
        "deepspeed_zero2.yaml",
        "deepspeed_zero3.yaml",
    }
    assert (EXAMPLES / "sae_ppo_math.py").is_file()
    assert (EXAMPLES / "notebooks" / "sae_ppo_qwen3_colab.ipynb").is_file()


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_parses_into_the_script_and_trainer_arguments(recipe):
    # Every key must be known to one of the two dataclasses (TrlParser rejects the rest).
    script_args, training_args = parse_recipe([str(recipe), "--use_cpu", "true", "--bf16", "false"])
    assert isinstance(script_args, ScriptArguments) and isinstance(training_args, SAEPPOConfig)
    raw = yaml.safe_load(recipe.read_text())
    assert training_args.advantage_estimator == raw["advantage_estimator"]
    assert script_args.model_name_or_path.startswith("Qwen/Qwen3-")
    # The paper's math recipes train on DAPO-Math-17k; its STEM domain on SCP-116K (tests/test_stem.py), its
    # CODE domain on DeepCoder's problems (tests/test_code_recipe.py).
    domain_data = {"qwen3_4b_base_stem.yaml": "scp-116k", "qwen3_4b_instruct_code.yaml": "code:deepcoder"}
    assert script_args.dataset_name == domain_data.get(recipe.name, "dapo-math-17k")
    assert (training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps) % (
        training_args.num_generations
    ) == 0


def test_the_paper_recipe_is_the_papers_setup():
    raw = yaml.safe_load((EXAMPLES / "paper_qwen3_8b_base.yaml").read_text())
    assert raw["model_name_or_path"] == "Qwen/Qwen3-8B-Base"
    assert raw["dataset_name"] == "dapo-math-17k"
    # 512 prompts x 8 samples = 4096 rollouts per step on 8 processes, one update on the whole batch
    assert 8 * raw["per_device_train_batch_size"] * raw["gradient_accumulation_steps"] == 4096
    assert raw["num_generations"] == 8 and raw["num_mini_batches"] == 1
    assert raw["temperature"] == 0.6 and raw["response_length"] == 8192
    assert raw["learning_rate"] == 1e-6 and raw["critic_learning_rate"] == 1e-5
    assert raw["segment_threshold"] == 0.2 and raw["kl_coef"] == 0 and raw["entropy_coef"] == 0
    assert raw["value_warmup_steps"] > 0 and raw.get("use_peft") is False


def test_the_dapo_style_recipe_stops_at_once_on_a_cpu_saying_it_is_a_gpu_recipe(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    # Before any model or dataset is fetched (offline here): the recipe's bf16 meets a machine without a GPU.
    assert main(["train", str(EXAMPLES / "dapo_style_sae.yaml")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("trl-sae train: error: ") and "bf16" in err[0]
    assert err[1] == (
        "hint: the recipe asks for bf16 mixed precision (bf16: true), which needs a GPU with bf16: the recipes "
        "in examples/*.yaml are GPU recipes, examples/real_model/smollm2_135m_gym_lora.yaml is the one sized "
        "for a CPU. To run this one here anyway, add --bf16 false (and --use_cpu true for CPU only)."
    )
    header = (EXAMPLES / "dapo_style_sae.yaml").read_text().split("\n\n# ----")[0]
    assert "# A GPU recipe: bf16 mixed precision" in header


def test_the_dapo_knobs_on_the_cpu_recipe_as_the_dapo_header_gives_them():
    # The command in dapo_style_sae.yaml's header parses into a CPU run with every DAPO knob on.
    header = (EXAMPLES / "dapo_style_sae.yaml").read_text()
    command = header[header.index("#   trl-sae train examples/real_model/") :].split("\n#\n")[0]
    argv = command.replace("#", " ").replace("\\", " ").split()[2:]
    assert argv[:3] == ["examples/real_model/smollm2_135m_gym_lora.yaml", "--model_name_or_path", '"$(python']
    flags = argv[5:]
    _, config = parse_recipe([str(EXAMPLES / "real_model" / "smollm2_135m_gym_lora.yaml"), *flags])
    assert config.use_cpu and not config.bf16
    assert config.cliprange_high == 0.28 and config.loss_agg_mode == "token-mean"
    assert (
        0 < config.overlong_buffer_length < config.response_length and config.overlong_penalty_factor == 1.0
    )
    assert config.mask_truncated_completions and config.filter_groups and config.max_num_gen_batches == 10


def test_the_dapo_style_recipe_is_its_lora_base_plus_the_dapo_knobs():
    base = yaml.safe_load((EXAMPLES / "qwen3_1.7b_lora.yaml").read_text())
    raw = yaml.safe_load((EXAMPLES / "dapo_style_sae.yaml").read_text())
    _, config = parse_recipe([str(EXAMPLES / "dapo_style_sae.yaml"), "--use_cpu", "true", "--bf16", "false"])
    assert config.advantage_estimator == "sae" and config.loss_agg_mode == "token-mean"
    assert (config.cliprange, config.cliprange_high) == (0.2, 0.28)
    assert (
        0 < config.overlong_buffer_length < config.response_length and config.overlong_penalty_factor == 1.0
    )
    assert config.mask_truncated_completions and config.stop_token == "eos"
    assert config.filter_groups and config.max_num_gen_batches == 10
    differing = {key for key in base.keys() | raw.keys() if base.get(key) != raw.get(key)}
    knobs = {"cliprange", "cliprange_high", "overlong_buffer_length", "overlong_penalty_factor"}
    knobs |= {"mask_truncated_completions", "loss_agg_mode", "stop_token", "temperature", "output_dir"}
    knobs |= {"filter_groups", "max_num_gen_batches"}
    assert differing <= knobs, differing - knobs


@pytest.mark.parametrize("baseline", sorted((EXAMPLES / "baselines").glob("*.yaml")), ids=recipe_id)
def test_baselines_switch_only_the_estimator(baseline):
    paper = yaml.safe_load((EXAMPLES / "paper_qwen3_8b_base.yaml").read_text())
    raw = yaml.safe_load(baseline.read_text())
    differing = {key for key in paper.keys() | raw.keys() if paper.get(key) != raw.get(key)}
    allowed = {"advantage_estimator", "output_dir"}
    if raw["advantage_estimator"] == "grpo":
        allowed.add("value_warmup_steps")  # no critic to pre-train; warm-up steps would freeze the actor
    assert differing <= allowed and "advantage_estimator" in differing
    assert raw["advantage_estimator"] == baseline.stem


@pytest.mark.parametrize("recipe", VLLM_RECIPES, ids=recipe_id)
def test_vllm_recipes_are_their_base_recipe_plus_vllm_settings(recipe):
    base = yaml.safe_load((EXAMPLES / recipe.name.replace("_vllm", "")).read_text())
    raw = yaml.safe_load(recipe.read_text())
    differing = {key for key in base.keys() | raw.keys() if base.get(key) != raw.get(key)}
    assert differing - {"output_dir", "use_vllm"} and all(
        key.startswith("vllm_") for key in differing - {"output_dir", "use_vllm"}
    )
    assert raw["use_vllm"] is True
    if raw["vllm_mode"] == "server":
        assert raw["vllm_server_host"] == "127.0.0.1"


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in VLLM_RECIPES], ids=recipe_id)
def test_recipe_dry_run_builds_the_trainer(capsys, tmp_path, tiny_dir, math_jsonl, recipe):
    code = main(["train", str(recipe), *offline_overrides(tmp_path, tiny_dir, math_jsonl), "--dry_run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "dry run" in out
    raw = yaml.safe_load(recipe.read_text())
    assert raw["advantage_estimator"] in out
    assert not (tmp_path / "out" / "model.safetensors").exists()  # nothing trained or saved


def test_train_one_step_then_card_and_push(tmp_path, tiny_dir, math_jsonl, monkeypatch, capsys):
    """The recipe path end to end: one PPO step, the model card, and the push (to a fake Hub)."""
    import huggingface_hub

    calls = []
    monkeypatch.setattr(
        huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(repo_id)
    )
    monkeypatch.setattr(
        huggingface_hub.HfApi, "upload_folder", lambda self, **kw: calls.append(kw["folder_path"]) or "url"
    )
    argv = [
        str(EXAMPLES / "qwen3_1.7b_lora.yaml"),
        *offline_overrides(tmp_path, tiny_dir, math_jsonl),
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "1",
        "--num_generations",
        "2",
        "--response_length",
        "4",
        "--value_warmup_steps",
        "0",
        "--max_eval_samples",
        "2",
        "--activation_checkpointing",
        "false",
        "--log_completions",
        "false",
        "--save_strategy",
        "no",
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "me/tiny-sae",
        "--eval_on_start",
        "true",
    ]
    script_args, training_args = parse_recipe(argv)
    summary = run_recipe(script_args, training_args)
    out = tmp_path / "out"
    assert summary["pushed"] and calls == ["me/tiny-sae", str(out)]
    assert "reward/mean" in summary and "eval/reward/mean" in summary
    # Issue 29: a run that evaluated ends with one before -> after line of its held-out metrics.
    number = r"-?[0-9.e+-]+|nan"
    assert re.fullmatch(
        rf"held-out \(one sample at temperature {training_args.temperature:g}\), step 0 -> 1: accuracy "
        rf"({number}) -> {re.escape(format(summary['eval/accuracy'], '.4g'))}; mean reward ({number}) -> "
        rf"{re.escape(format(summary['eval/reward/mean'], '.4g'))}",
        summary["held_out"],
    ), summary["held_out"]
    assert capsys.readouterr().out.rstrip().endswith(summary["held_out"])
    assert (out / "adapter_config.json").is_file()  # LoRA recipe: adapter only by default
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "| `advantage_estimator` | sae |" in card


@pytest.mark.parametrize(("num_processes", "ended"), [(1, False), (2, True)])
def test_a_run_ends_its_process_group_only_with_several_processes(num_processes, ended):
    """With several processes the group goes down before exit (a gloo rank exiting with it up can abort);
    one process keeps it for a colocated vLLM engine that initialised it."""
    from types import SimpleNamespace

    from trl_sae.recipe import end_distributed_run

    calls = []
    accelerator = SimpleNamespace(num_processes=num_processes, end_training=lambda: calls.append("end"))
    end_distributed_run(SimpleNamespace(accelerator=accelerator))
    assert calls == (["end"] if ended else [])


def test_example_script_help_and_dry_run(capsys, tmp_path, tiny_dir, math_jsonl):
    spec = importlib.util.spec_from_file_location("sae_ppo_math", EXAMPLES / "sae_ppo_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "accelerate launch" in text and "--segment_threshold" in text
    result = module.main(
        [
            "--config",
            str(EXAMPLES / "baselines" / "grpo.yaml"),
            *offline_overrides(tmp_path, tiny_dir, math_jsonl),
            "--dry_run",
        ]
    )
    assert result == {"dry_run": True}


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(config))
    expected = {
        "single_gpu.yaml": ("NO", None),
        "multi_gpu.yaml": ("MULTI_GPU", None),
        "fsdp2.yaml": ("FSDP", None),
        "deepspeed_zero2.yaml": ("DEEPSPEED", 2),
        "deepspeed_zero3.yaml": ("DEEPSPEED", 3),
    }[config.name]
    assert str(loaded.distributed_type).split(".")[-1] == expected[0]
    if expected[1] is not None:
        assert loaded.deepspeed_config["zero_stage"] == expected[1]
    if config.name == "fsdp2.yaml":
        assert loaded.fsdp_config["fsdp_version"] == 2
        assert loaded.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
        assert loaded.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3DecoderLayer"
    assert loaded.mixed_precision == "bf16"


def test_lora_layers_to_transform_puts_adapters_on_those_layers_only(tmp_path, tiny_dir, math_jsonl):
    from trl_sae.recipe import build_trainer

    recipe = str(EXAMPLES / "qwen3_1.7b_lora.yaml")
    lora = ["--lora_target_modules", "q_proj", "v_proj", "--lora_layers_to_transform", "1"]
    script_args, training_args = parse_recipe(
        [recipe, *offline_overrides(tmp_path, tiny_dir, math_jsonl), *lora]
    )
    assert script_args.lora_layers_to_transform == [1]
    trainer, _, _ = build_trainer(script_args, training_args)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    adapted = {
        name.split(".layers.")[1].split(".")[0]
        for name, _ in policy.named_parameters()
        if "lora_A.default" in name
    }
    assert adapted == {"1"}  # the tiny model has layers 0 and 1; layer 0 stays plain

    script_args, training_args = parse_recipe(
        [recipe, *offline_overrides(tmp_path, tiny_dir, math_jsonl), "--lora_layers_to_transform", "1"]
    )
    with pytest.raises(ValueError, match="lora_layers_to_transform needs lora_target_modules"):
        build_trainer(script_args, training_args)
    script_args, training_args = parse_recipe(
        [
            recipe,
            *offline_overrides(tmp_path, tiny_dir, math_jsonl),
            *lora[:3],
            "--lora_layers_to_transform",
            "1",
            "1",
        ]
    )
    with pytest.raises(ValueError, match=r"distinct layer indices >= 0, got \[1, 1\]"):
        build_trainer(script_args, training_args)


def test_the_cpu_recipe_ships_the_settings_its_recorded_run_measured():
    # The README and runs.md (run 18) report this file's own run; these are the settings that run and issue 31's
    # 8 fresh seeds used. Changing one means measuring the file again and updating both.
    script_args, config = parse_recipe([str(EXAMPLES / "real_model" / "smollm2_135m_gym_lora.yaml")])
    assert script_args.value_model_name_or_path == "head"
    assert (
        config.num_generations,
        config.per_device_train_batch_size * config.gradient_accumulation_steps,
    ) == (8, 32)
    assert (config.num_mini_batches, config.num_ppo_epochs, config.max_steps) == (1, 1, 24)
    assert (config.learning_rate, config.critic_learning_rate) == (3e-4, 3e-4)
    assert config.lr_scheduler_type == "constant" and config.loss_agg_mode == "token-mean"
    assert not config.use_vllm and config.advantage_estimator == "sae" and config.seed == 0
