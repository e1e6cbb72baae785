"""Code datasets in recipes and ``trl-sae eval``: ``code_task`` (generated) and ``code:<source>`` (a file),
held-out sets without training problems, ``code_tests`` as the eval reward, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trl_sae.cli.app import main
from trl_sae.code_recipe import parse_code_name
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.recipe import ScriptArguments, load_recipe_datasets, parse_recipe, run_recipe

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "real_model" / "smollm2_135m_code_lora.yaml"

# MBPP layout: two of the five problems are also in the held-out file below.
MBPP_ROWS = [
    {
        "text": f"Write a function add_{i}(x) that returns x + {i}.",
        "test_list": [f"assert add_{i}(1) == {i + 1}"],
    }
    for i in range(5)
]
HELD_OUT_ROWS = MBPP_ROWS[3:] + [
    {
        "text": f"Write a function add_{i}(x) that returns x + {i}.",
        "test_list": [f"assert add_{i}(2) == {i + 2}"],
    }
    for i in range(5, 8)
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-policy")
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mbpp_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mbpp")
    return write_jsonl(folder / "train.jsonl", MBPP_ROWS), write_jsonl(folder / "test.jsonl", HELD_OUT_ROWS)


def code_args(**overrides) -> ScriptArguments:
    settings = {"dataset_name": "code_task", "reward_funcs": ["code_tests"], "max_train_samples": 14}
    return ScriptArguments(**{**settings, **overrides})


# --------------------------------------------------------------------------------------------------
# Recipe datasets.
# --------------------------------------------------------------------------------------------------
def test_code_names():
    assert parse_code_name("code_task") == ("task", None)
    assert parse_code_name("code:data/p.jsonl") == ("source", "data/p.jsonl")
    assert parse_code_name("dapo-math-17k") is None and parse_code_name(None) is None
    with pytest.raises(ValueError, match="name the source after 'code:'"):
        parse_code_name("code:")


def test_the_generated_task_honours_its_config_and_holds_out_other_problems():
    config = '{"families": ["affine", "count_char"], "num_tests": 3, "few_shot": 2}'
    script_args = code_args(
        eval_dataset_name="code_task", max_eval_samples=40, code_task_config=config, system_prompt="Be brief."
    )
    train, evaluation = load_recipe_datasets(script_args, seed=3)
    assert len(train) == 14 and set(train["family"]) == {"affine", "count_char"}
    assert all(len(json.loads(t)["inputs"]) == 3 for t in train["tests"])
    # system, two solved problems (user + assistant), then the question
    prompt = train[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert prompt[0]["content"] == "Be brief." and prompt[2]["content"].startswith("```python\ndef solve")
    assert prompt[-1]["content"] == train[0]["question"]
    shots = {prompt[1]["content"], prompt[3]["content"]}
    # held out: another seed, no training problem, no solved example, no repeat
    assert 0 < len(evaluation) <= 40
    held_out = set(evaluation["question"])
    assert len(held_out) == len(evaluation)
    assert not held_out & set(train["question"]) and not held_out & shots
    assert not shots & set(train["question"])
    again, _ = load_recipe_datasets(script_args, seed=3)
    assert again["tests"] == train["tests"]  # the seed fixes the problems
    other, _ = load_recipe_datasets(script_args, seed=4)
    assert other["tests"] != train["tests"]


def test_the_held_out_set_leaves_out_repeated_training_problems():
    # digit_sum has no constants: only its example differs, so some problems repeat across 200 draws.
    script_args = code_args(
        max_train_samples=200,
        eval_dataset_name="code_task",
        max_eval_samples=200,
        code_task_config='{"families": ["digit_sum"], "num_tests": 1}',
    )
    train, evaluation = load_recipe_datasets(script_args, seed=0)
    assert not set(train["question"]) & set(evaluation["question"])
    assert len(evaluation) == len(set(evaluation["question"]))


def test_a_code_file_trains_and_its_held_out_file_loses_the_shared_problems(mbpp_files):
    train_path, test_path = mbpp_files
    script_args = code_args(
        dataset_name=f"code:{train_path}", eval_dataset_name=f"code:{test_path}", max_train_samples=None
    )
    train, evaluation = load_recipe_datasets(script_args)
    assert len(train) == 5 and len(evaluation) == 3  # rows 3 and 4 are training problems
    assert [json.loads(t)["fn_name"] for t in evaluation["tests"]] == ["add_5", "add_6", "add_7"]
    limited, _ = load_recipe_datasets(code_args(dataset_name=f"code:{train_path}", max_train_samples=2))
    assert len(limited) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"code_task_config": '{"family": ["affine"]}'}, "code_task_config: unknown keys ['family']"),
        (
            {"code_task_config": '{"families": ["nope"]}'},
            "code_task_config: families must be a non-empty list",
        ),
        ({"code_task_config": '{"few_shot": -1}'}, "code_task_config: few_shot must be an integer >= 0"),
        ({"code_task_config": '{"num_tests": 0}'}, "code_task_config: num_tests must be an integer >= 1"),
        ({"code_task_config": "[1]"}, "code_task_config: must be a JSON object"),
        ({"code_task_config": "{"}, "code_task_config: not a JSON object"),
        ({"max_train_samples": None}, "max_train_samples: set how many code_task problems"),
        ({"dataset_split": "train"}, "dataset_split: code_task has no splits"),
        ({"eval_dataset_name": "code_task"}, "max_eval_samples: set how many code_task problems"),
        ({"eval_dataset_name": "aime-2024"}, "eval_dataset_name: 'aime-2024' is not a code dataset"),
        ({"reward_funcs": ["math_accuracy"]}, "reward_funcs: math_accuracy cannot grade code"),
        ({"reasoning_gym_few_shot": 2}, "reasoning_gym_few_shot applies to reasoning_gym:<task> datasets"),
        (
            {"dataset_name": "x.jsonl", "eval_dataset_name": "code_task"},
            "eval_dataset_name: 'code_task' is a",
        ),
        ({"dataset_name": "x.jsonl", "code_task_config": "{}"}, "code_task_config is set but no dataset is"),
    ],
)
def test_bad_code_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("(", r"\(")) as error:
        load_recipe_datasets(code_args(**overrides))
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------------------------------
# The CPU recipe, on the tiny model.
# --------------------------------------------------------------------------------------------------
def tiny_overrides(tiny_dir: Path, out: Path) -> list[str]:
    return [
        "--model_name_or_path", str(tiny_dir), "--output_dir", str(out),
        "--max_train_samples", "8", "--max_eval_samples", "6",
        "--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--response_length", "8", "--lora_layers_to_transform", "0", "1",
        "--log_completions", "false", "--merge_adapters", "false",
    ]  # fmt: skip


def test_the_code_recipe_is_the_gym_recipe_on_the_code_task():
    import yaml

    gym = yaml.safe_load((RECIPE.parent / "smollm2_135m_gym_lora.yaml").read_text())
    raw = yaml.safe_load(RECIPE.read_text())
    differing = {key for key in gym.keys() | raw.keys() if gym.get(key) != raw.get(key)}
    data = {"dataset_name", "eval_dataset_name", "reasoning_gym_config", "reasoning_gym_few_shot"}
    data |= {"code_task_config", "max_train_samples", "max_eval_samples", "reward_funcs"}
    assert differing <= data | {"response_length", "max_steps", "output_dir"}, differing
    assert raw["dataset_name"] == raw["eval_dataset_name"] == "code_task"
    assert raw["reward_funcs"] == ["code_tests"] and 96 <= raw["response_length"] <= 128
    script_args, config = parse_recipe([str(RECIPE)])
    assert config.use_cpu and config.eval_on_start and config.eval_temperature == 0
    _, evaluation = load_recipe_datasets(script_args, seed=config.seed)
    assert 90 <= len(evaluation) <= 110  # about 100 held-out problems


def test_the_code_recipe_dry_run_builds_the_trainer(capsys, tmp_path, tiny_dir):
    code = main(["train", str(RECIPE), *tiny_overrides(tiny_dir, tmp_path / "out"), "--dry_run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "dry run" in out and "code_tests" in out


def test_the_code_recipe_trains_one_step_and_evaluates_with_the_sandbox(tmp_path, tiny_dir):
    argv = [
        str(RECIPE),
        *tiny_overrides(tiny_dir, tmp_path / "out"),
        "--max_steps",
        "1",
        "--eval_on_start",
        "true",
    ]
    script_args, training_args = parse_recipe(argv)
    summary = run_recipe(script_args, training_args)
    assert summary["reward_funcs"] == ["code_tests"]
    assert summary["train_prompts"] == 8 and 0 < summary["eval_prompts"] <= 6
    # the tiny model writes no code block in 8 tokens: every completion scores 0
    assert summary["reward/mean"] == 0.0 and summary["eval/accuracy"] == 0.0


# --------------------------------------------------------------------------------------------------
# trl-sae eval.
# --------------------------------------------------------------------------------------------------
def test_eval_grades_code_with_code_tests(capsys, monkeypatch, tiny_dir, mbpp_files, tmp_path):
    """Canned completions: the right function for code_task's affine problems and for add_5 and add_7,
    a wrong one otherwise, a block in another language for add_6."""
    _, test_path = mbpp_files

    def fake_generate(
        model, tokenizer, prompts, max_new_tokens, temperature, num_samples, batch_size, progress
    ):
        texts = []
        for prompt in prompts:
            text = prompt[-1]["content"]
            if "add_" in text:
                i = int(text.split("add_")[1][0])
                lang = "cpp" if i == 6 else "python"
                texts.append(f"```{lang}\ndef add_{i}(x):\n    return x + {i if i != 6 else 0}\n```")
            elif "* x +" in text:  # affine: "returns A * x + B."
                a, b = text.split("returns ")[1].split(".\n")[0].split(" * x + ")
                texts.append(f"```python\ndef solve(x):\n    return {a} * x + {b}\n```")
            else:
                texts.append("```python\ndef solve(*args):\n    return None\n```")
        return texts, [[1]] * len(texts)

    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    output = tmp_path / "eval.json"
    code = main(
        ["eval", "--model", str(tiny_dir), "--datasets", "code_task", f"code:{test_path}",
         "--code-task-config", '{"families": ["affine", "digit_sum"]}', "--limit", "6",
         "--output", str(output), "--no-progress"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    results = json.loads(output.read_text())["results"]
    assert results["code_task"]["per_problem"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    # add_3, add_4: `return x + 3` passes; add_5, add_7 pass; add_6 is C++
    assert results[f"code:{test_path}"]["per_problem"] == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_eval_of_the_recipe_uses_its_held_out_code_task(capsys, monkeypatch, tiny_dir, tmp_path):
    seen = []

    def fake_generate(
        model, tokenizer, prompts, max_new_tokens, temperature, num_samples, batch_size, progress
    ):
        seen.append((prompts, max_new_tokens))
        return ["no code"] * len(prompts), [[1]] * len(prompts)

    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    output = tmp_path / "eval.json"
    code = main(["eval", "--model", str(tiny_dir), "--recipe", str(RECIPE), "--limit", "5", "--output", str(output),
                 "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    (result,) = json.loads(output.read_text())["results"].values()
    assert result["num_prompts"] == 5 and result["accuracy"] == 0.0
    script_args, config = parse_recipe([str(RECIPE)])
    _, evaluation = load_recipe_datasets(script_args, seed=config.seed)
    assert seen == [(evaluation["prompt"][:5], config.response_length)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--datasets", "code_task", "--code-task-config", '{"x": 1}'],
            "--code-task-config: unknown keys ['x']",
        ),
        (["--datasets", "code_task", "--split", "test"], "--split: code_task has no splits"),
        (
            ["--datasets", "aime-2024", "--code-task-config", "{}"],
            "--code-task-config applies to the code_task",
        ),
        (["--datasets", "code:"], "dataset 'code:': name the source after 'code:'"),
    ],
)
def test_eval_refuses_bad_code_arguments_in_one_line(capsys, tiny_dir, argv, message):
    code = main(["eval", "--model", str(tiny_dir), *argv, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"trl-sae eval: error: {message}")


def test_the_gpu_code_recipe_is_the_papers_code_setup():
    """examples/qwen3_4b_instruct_code.yaml: the paper's CODE domain (Qwen3-4B-Instruct on DeepCoder's problems,
    all-or-nothing tests) with Section 5.1's PPO settings, parsed as `trl-sae train` parses it."""
    import yaml

    from trl_sae.recipe import parse_recipe
    from trl_sae.rewards.code import code_tests
    from trl_sae.rewards.registry import REWARD_FUNCTIONS

    path = Path(__file__).resolve().parents[1] / "examples" / "qwen3_4b_instruct_code.yaml"
    raw = yaml.safe_load(path.read_text())
    script_args, args = parse_recipe([str(path), "--use_cpu", "true", "--bf16", "false"])
    assert script_args.model_name_or_path == "Qwen/Qwen3-4B-Instruct-2507"
    assert script_args.dataset_name == "code:deepcoder" and script_args.eval_dataset_name == "code:apps"
    # code_tests scores all or nothing (tests/test_code_reward.py), as the paper's DeepCoder recipe does
    assert raw["reward_funcs"] == ["code_tests"] and REWARD_FUNCTIONS["code_tests"] is code_tests
    # 512 prompts x 8 samples = 4096 rollouts per step on 8 processes, one update on the whole batch
    assert 8 * args.per_device_train_batch_size * args.gradient_accumulation_steps == 4096
    assert args.num_generations == 8 and args.num_mini_batches == 1 and args.num_ppo_epochs == 1
    assert args.temperature == 0.6 and args.response_length == 8192
    assert args.learning_rate == 1e-6 and args.critic_learning_rate == 1e-5
    assert args.segment_threshold == 0.2 and args.kl_coef == 0 and args.entropy_coef == 0
    assert args.advantage_estimator == "sae" and args.value_warmup_steps > 0


# --------------------------------------------------------------------------------------------------
# code_sandbox: the recipe's (and trl-sae eval's) choice of the code_tests sandbox.
# --------------------------------------------------------------------------------------------------
def test_code_sandbox_builds_code_tests_with_that_backend_and_the_default_is_the_registry_one():
    from trl_sae.recipe import resolve_reward_funcs
    from trl_sae.rewards.code import code_tests

    assert resolve_reward_funcs(["code_tests"]) == [code_tests]
    (reward,) = resolve_reward_funcs(["code_tests"], "auto")
    assert reward.sandbox.backend == "auto" and reward.__name__ == "code_tests"
    assert reward.sandbox.resolved_backend in ("bwrap", "namespaces")


@pytest.mark.parametrize(
    "names, sandbox, message",
    [
        (["math_accuracy"], "bwrap", "code_sandbox: bwrap chooses the sandbox of the code_tests reward"),
        (
            ["code_tests"],
            "docker",
            "code_sandbox must be one of ['namespaces', 'bwrap', 'auto'], got 'docker'",
        ),
    ],
)
def test_a_code_sandbox_that_would_be_ignored_or_is_unknown_is_refused(names, sandbox, message):
    from trl_sae.recipe import resolve_reward_funcs

    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[")):
        resolve_reward_funcs(names, sandbox)


def test_a_bwrap_sandbox_that_cannot_run_is_one_line_naming_the_setting(monkeypatch):
    from trl_sae.recipe import resolve_reward_funcs
    from trl_sae.rewards.sandbox import Sandbox

    monkeypatch.setattr(Sandbox, "_bwrap_unusable", lambda self: "bwrap is not installed")
    with pytest.raises(ValueError, match=r"^code_sandbox: bwrap: .*bwrap is not installed") as error:
        resolve_reward_funcs(["code_tests"], "bwrap")
    assert "\n" not in str(error.value)


def test_the_recipe_trainer_grades_with_the_chosen_sandbox_and_refuses_before_loading(
    tmp_path, tiny_dir, monkeypatch
):
    from trl_sae.recipe import build_trainer

    script_args, training_args = parse_recipe(
        [str(RECIPE), *tiny_overrides(tiny_dir, tmp_path / "out"), "--code_sandbox", "auto", "--dry_run"]
    )
    trainer, _, _ = build_trainer(script_args, training_args)
    (reward,) = trainer.reward_funcs
    assert reward.sandbox.backend == "auto"
    script_args, training_args = parse_recipe(
        [str(RECIPE), *tiny_overrides(tiny_dir, tmp_path / "out2"), "--code_sandbox", "auto",
         "--reward_funcs", "math_accuracy", "--dry_run"]
    )  # fmt: skip
    monkeypatch.setattr(
        "trl_sae.gguf.tokenizer_from_pretrained", lambda *a, **k: pytest.fail("loaded before the refusal")
    )
    with pytest.raises(ValueError, match=r"^code_sandbox: auto chooses the sandbox"):
        build_trainer(script_args, training_args)


@pytest.fixture
def eval_graders(monkeypatch) -> list:
    """The grader of each dataset ``trl-sae eval`` evaluates, in order; every completion is one small program."""
    import trl_sae.cli.eval as eval_cli

    graders, evaluate = [], eval_cli._evaluate

    def recording_evaluate(model, tokenizer, dataset, grader, args):
        graders.append(grader)
        return evaluate(model, tokenizer, dataset, grader, args)

    def fake_generate(model, tokenizer, prompts, *args, **kwargs):
        return ["```python\ndef solve(x):\n    return x\n```"] * len(prompts), [[1]] * len(prompts)

    monkeypatch.setattr(eval_cli, "_evaluate", recording_evaluate)
    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    return graders


def test_eval_code_sandbox_reaches_the_grader_and_is_refused_without_code(
    capsys, eval_graders, tiny_dir, tmp_path
):
    code = main(["eval", "--model", str(tiny_dir), "--datasets", "code_task", "--limit", "2", "--code-sandbox",
                 "auto", "--output", str(tmp_path / "e.json"), "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    (grader,) = eval_graders
    assert grader.sandbox.backend == "auto"
    code = main(["eval", "--model", str(tiny_dir), "--datasets", "aime-2024", "--code-sandbox", "bwrap",
                 "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "--code-sandbox chooses the sandbox of the code_tests reward" in err


def test_eval_of_a_recipe_grades_with_its_code_sandbox_unless_the_flag_says_otherwise(
    capsys, eval_graders, tiny_dir, tmp_path
):
    from trl_sae.rewards.code import code_tests

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.read_text() + "\ncode_sandbox: auto\n")
    for extra in ([], ["--code-sandbox", "namespaces"]):
        code = main(["eval", "--model", str(tiny_dir), "--recipe", str(recipe), "--limit", "2", "--no-progress",
                     *extra])  # fmt: skip
        assert code == 0, capsys.readouterr().err
    assert eval_graders[0].sandbox.backend == "auto"
    assert eval_graders[1] is code_tests  # the registry's: the namespaces backend
