"""The `trl-sae` command line, offline: help texts, one-line errors, and every command on tiny models."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from trl_sae.cli import common, segments
from trl_sae.cli.app import main
from trl_sae.demo.tiny import build_tiny_qwen3, build_tiny_qwen3_critic

COMMANDS = ["demo", "train", "eval", "segments", "correlate", "segstats", "docs"]
RECIPE = str(Path(__file__).resolve().parents[1] / "examples" / "qwen3_1.7b_lora.yaml")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny Qwen3 + tokenizer saved like a Hub checkpoint, with a critic in value_model/."""
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    build_tiny_qwen3_critic(tokenizer, seed=1).save_pretrained(path / "value_model")
    return path


@pytest.fixture(scope="module")
def math_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "math.jsonl"
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "example" in text.lower()
    assert f"trl-sae {command}" in text


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(command in text for command in COMMANDS)
    assert main([]) == 2  # no command: usage, not a traceback


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["segments", "--model", "./no/such/model", "--text", "hi"],
            "--model: no such directory './no/such/model'",
        ),
        (["segments", "--model", "Qwen/Qwen3-0.6B", "--file", "missing.jsonl"], "does not exist"),
        (["train", "no_such_recipe.yaml"], "recipe 'no_such_recipe.yaml' does not exist"),
        (["eval", "--model", "/no/such/dir", "--datasets", "no_such.jsonl"], "no file or folder at"),
        (
            ["eval", "--model", "/no/such/dir", "--datasets", str(Path(__file__).resolve())],
            "use a .json, .jsonl",
        ),
        (["docs", "--check", "no_such_config.md"], "does not exist"),
        (
            ["train", RECIPE, "--model_name_or_path", "./nope", "--use_cpu", "true"],
            "model_name_or_path: no such directory './nope'",
        ),
        (
            ["train", RECIPE, "--no_such_flag", "1", "--use_cpu", "true"],
            "no_such_flag",
        ),
        (
            ["train", RECIPE, "--per_device_train_batch_size", "0", "--use_cpu", "true"],
            "SAEPPOConfig.per_device_train_batch_size: must be >= 1, got 0",
        ),
    ],
)
def test_user_errors_are_one_line_not_a_traceback(capsys, argv, expected):
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert "Traceback" not in err
    first = err.strip().splitlines()[0]
    assert first.startswith(f"trl-sae {argv[0]}: error:") and expected in first


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["segstats", "--model", "m", "--p-grid", "0.2,1.5"],
            "--p-grid: expected thresholds strictly between 0 and 1",
        ),
        (
            ["correlate", "--model", "m", "--p-grid", "0"],
            "--p-grid: expected thresholds strictly between 0 and 1",
        ),
        (["correlate", "--model", "m", "--lam-grid", "0.9,2"], "--lam-grid: expected lambdas in [0, 1]"),
    ],
)
def test_grids_outside_their_range_are_refused_by_the_parser(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_every_model_argument_says_it_takes_a_gguf_file():
    # Each takes a *.gguf path (trl_sae.gguf.resolve_pretrained), so each help says so.
    import dataclasses

    from trl_sae.cli.app import build_parser
    from trl_sae.recipe import ScriptArguments

    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    helps = {
        f"{name} {action.option_strings[0]}": action.help
        for name, sub in commands.choices.items()
        for action in sub._actions
        if action.dest.endswith("model")
    }
    assert set(helps) >= {
        "eval --model",
        "segments --model",
        "correlate --model",
        "correlate --value-model",
        "segstats --model",
    }
    fields = {f.name: f.metadata["help"] for f in dataclasses.fields(ScriptArguments)}
    for name in ("model_name_or_path", "value_model_name_or_path", "tokenizer_name_or_path"):
        helps[f"train --{name}"] = fields[name]
    for where, text in helps.items():
        assert "Hub id" in text and "folder" in text and "*.gguf file" in text, (where, text)


def test_the_reward_funcs_help_names_every_built_in_reward(capsys, monkeypatch):
    """Read from the registry, not written out: `trl-sae train --help` lists each name, a new one too."""
    from trl_sae import recipe
    from trl_sae.rewards.registry import REWARD_FUNCTIONS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"REWARD_FUNCTIONS \(([^)]*)\)", text)
    assert listed and listed.group(1).split(", ") == list(REWARD_FUNCTIONS)
    monkeypatch.setitem(REWARD_FUNCTIONS, "my_reward", lambda prompts, completions, completion_ids, **_: [])
    assert "code_tests, my_reward)" in recipe._reward_funcs_help()


def test_unknown_recipe_keys_and_options_name_the_nearest_fields(capsys, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model_name_or_path: m\nlearning_rat: 1.0e-5\nfoo_bar_baz: 1\nuse_cpu: true\n")
    code, _, err = run(capsys, "train", str(recipe))
    assert code == 1 and "fail_with_unknown_args" not in err and "Traceback" not in err
    assert err.splitlines() == [
        f"trl-sae train: error: recipe {recipe}: unknown keys 'learning_rat' (did you mean learning_rate or "
        "critic_learning_rate or value_pretrain_learning_rate?), 'foo_bar_baz' (no field is named alike)",
        "hint: `trl-sae train --help` lists every field; a recipe key or --option sets the field of that name.",
    ]
    recipe.write_text("model_name_or_path: m\nuse_cpu: true\n")
    code, _, err = run(capsys, "train", str(recipe), "--segment_treshold", "0.3")
    assert code == 1 and err.splitlines()[0] == (
        "trl-sae train: error: unknown option --segment_treshold (did you mean --segment_threshold or "
        "--entropy_threshold or --segmentation?)"
    )


def test_recipe_errors_come_with_a_hint(capsys, tiny_dir, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, _, err = run(capsys, "train", RECIPE, "--use_cpu", "false")
    assert code == 1 and "Traceback" not in err
    assert "error:" in err and "hint: the recipe asks for bf16 mixed precision (bf16: true)" in err
    assert "add --bf16 false (and --use_cpu true for CPU only)" in err

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'BytedTsinghua-SIA/DAPO-Math-17k' on the Hub")

    monkeypatch.setattr("datasets.load_dataset", unreachable)
    argv = [RECIPE, "--model_name_or_path", str(tiny_dir), "--use_cpu", "true"]
    code, _, err = run(capsys, "train", *argv, "--bf16", "false", "--dry_run")
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[0].startswith(
        "trl-sae train: error: Could not load 'BytedTsinghua-SIA/DAPO-Math-17k'"
    )
    assert err.splitlines()[1].startswith("hint: offline?")


def test_offline_dataset_is_a_clear_error_with_a_hint(capsys, tiny_dir, monkeypatch):
    from trl_sae import data

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/aime_2024' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr("datasets.load_dataset", unreachable)
    assert data.MATH_DATASETS["aime-2024"]
    code, _, err = run(capsys, "eval", "--model", str(tiny_dir), "--datasets", "aime-2024")
    assert code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("trl-sae eval: error: Could not load 'HuggingFaceH4/aime_2024'")
    assert lines[1].startswith("hint: offline?")


@pytest.mark.parametrize("command", ["eval", "train"])
def test_an_empty_dataset_file_is_one_line(capsys, tmp_path, tiny_dir, command):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    if command == "eval":
        argv = ["eval", "--model", str(tiny_dir), "--datasets", str(empty)]
    else:
        argv = ["train", RECIPE, "--model_name_or_path", str(tiny_dir), "--dataset_name", str(empty)]
        argv += ["--use_cpu", "true", "--bf16", "false", "--dry_run", "--output_dir", str(tmp_path / "out")]
    code, _, err = run(capsys, *argv)
    assert code == 1 and "Traceback" not in err and "StopIteration" not in err
    assert err.splitlines()[
        0
    ] == f"trl-sae {command}: error: {str(empty)!r} has no rows: put one problem per row " + (
        'with its answer, e.g. the .jsonl line {"problem": "What is 2 + 2?", "answer": "4"}.'
    )


def test_eval_reports_avg_and_pass_at_k(capsys, tmp_path, tiny_dir, math_jsonl, monkeypatch):
    """avg@k and pass@k from math-verify, with the generator replaced by canned completions."""
    answers = [str(2 * i) for i in range(6)]
    seen = {}

    def fake_generate(
        model, tokenizer, prompts, max_new_tokens, temperature, num_samples, batch_size, progress
    ):
        seen.update(num_prompts=len(prompts), num_samples=num_samples, temperature=temperature)
        texts = []
        for i in range(len(prompts)):
            for j in range(num_samples):
                # Problem i is solved by its first i % 3 samples: 0, 1 or 2 of 4.
                value = answers[i] if j < i % 3 else "-1"
                texts.append(f"The sum is \\boxed{{{value}}}.")
        return texts, [[1, 2, 3]] * len(texts)

    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    output = tmp_path / "eval.json"
    code, out, err = run(
        capsys,
        "eval",
        "--model",
        str(tiny_dir),
        "--datasets",
        str(math_jsonl),
        "-k",
        "4",
        "--temperature",
        "0.6",
        "--output",
        str(output),
        "--save-samples",
        "--no-progress",
    )
    assert code == 0, err
    assert seen == {"num_prompts": 6, "num_samples": 4, "temperature": 0.6}
    result = json.loads(output.read_text())["results"][str(math_jsonl)]
    assert result["accuracy"] == pytest.approx((0 + 1 + 2) * 2 / 24)  # avg@4
    assert result["pass_at_k"] == pytest.approx(4 / 6)  # problems with >= 1 correct sample
    assert "avg@4" in out and "pass@4" in out
    samples = json.loads(output.with_suffix(".samples.json").read_text())[str(math_jsonl)]
    assert len(samples) == 24 and samples[1]["reward"] in (0.0, 1.0)


def test_segments_marks_the_probability_boundaries(capsys, tmp_path, tiny_dir):
    html = tmp_path / "seg.html"
    code, out, err = run(
        capsys,
        "segments",
        "--model",
        str(tiny_dir),
        "--prompt",
        "Add: 3 5",
        "--text",
        "3+5=8\nANSWER 8",
        "-p",
        "0.5",
        "--no-color",
        "--html",
        str(html),
    )
    assert code == 0, err
    # An untrained char model spreads probability over ~100 tokens: every token is below p = 0.5.
    header, rendered = out.splitlines()[0], out.splitlines()[1:3]
    assert header.startswith("[1] 14 tokens, 14 segments at p = 0.5")
    assert "\n".join(rendered) == "3|+|5|=|8|↵\n|A|N|S|W|E|R| |8"
    page = html.read_text()
    assert page.count('class="seg ') == 14 and "p = 0.5" in page


def test_segments_reads_a_jsonl_file_and_matches_teacher_forcing(tmp_path, tiny_dir, tokenizer):
    from trl_sae import forward_logprobs, probability_boundaries

    model, tok = common.load_causal_lm(str(tiny_dir), device="cpu")
    rows = [{"prompt": "Add: 1 2", "completion": "1+2=3"}, {"completion": "ANSWER 3"}]
    records = segments.segment_texts(model, tok, rows, threshold=0.02, chat=True)
    assert [len(r["completion_tokens"]) for r in records] == [5, 8]
    prompt = torch.tensor([segments._prompt_ids(tok, "Add: 1 2", chat=True)])
    completion = torch.tensor([tok("1+2=3", add_special_tokens=False)["input_ids"]])
    logprobs, _ = forward_logprobs(
        model, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion)
    )
    assert records[0]["logprobs"] == pytest.approx(logprobs[0].tolist(), abs=1e-5)
    expected = probability_boundaries(logprobs, torch.ones_like(completion), 0.02)[0].tolist()
    assert records[0]["boundaries"] == expected


def test_segstats_writes_table_json_and_figure(capsys, tmp_path, tiny_dir):
    out_dir = tmp_path / "segstats"
    code, _, err = run(
        capsys,
        "segstats",
        "--model",
        str(tiny_dir),
        "--task",
        "running-sum",
        "--limit",
        "4",
        "--num-samples",
        "4",
        "--max-new-tokens",
        "8",
        "--p-grid",
        "0.1,0.5",
        "--output-dir",
        str(out_dir),
        "--no-progress",
    )
    assert code == 0, err
    rows = json.loads((out_dir / "segstats.json").read_text())["rows"]
    assert [r["p"] for r in rows] == [0.1, 0.5]
    assert rows[0]["boundaries_per_completion"] <= rows[1]["boundaries_per_completion"]
    assert (out_dir / "segstats.png").stat().st_size > 0
    assert "| 0.5 |" in (out_dir / "segstats.md").read_text()


def test_correlate_writes_table_json_and_figure(capsys, tmp_path, tiny_dir):
    out_dir = tmp_path / "corr"
    code, _, err = run(
        capsys,
        "correlate",
        "--model",
        str(tiny_dir),
        "--task",
        "running-sum",
        "--limit",
        "4",
        "--num-trajectories",
        "4",
        "--num-spans",
        "1",
        "--num-continuations",
        "2",
        "--num-bootstrap",
        "10",
        "--max-new-tokens",
        "6",
        "--p-grid",
        "0.2",
        "--lam-grid",
        "0.9,1.0",
        "--output-dir",
        str(out_dir),
        "--no-progress",
    )
    assert code == 0, err
    result = json.loads((out_dir / "correlation.json").read_text())
    labels = [(r["estimator"], r["setting"]) for r in result["rows"]]
    assert ("sae", "p=0.2, lam=0.95") in labels and ("gae", "lam=1") in labels
    assert (out_dir / "correlation.png").stat().st_size > 0
    assert "| sae |" in (out_dir / "correlation.md").read_text()


def test_correlate_without_a_critic_says_how_to_pass_one(capsys, tmp_path):
    model_dir = tmp_path / "policy-only"
    model_dir.mkdir()
    code, _, err = run(capsys, "correlate", "--model", str(model_dir), "--task", "running-sum")
    assert code == 1 and "--value-model" in err


@pytest.mark.parametrize("task", ["running_sum", "decision"])
def test_the_demos_segments_hint_is_the_tasks_own_and_runs(capsys, tmp_path, tiny_dir, task):
    """The command the demo ends with shows one of the task's held-out prompts and a correct first line of
    its completion, and runs (on a model with the demo's character tokenizer)."""
    from trl_sae.demo.decision_task import decision_char_positions, make_walk_dataset
    from trl_sae.demo.run import segments_command
    from trl_sae.demo.tasks import make_running_sum_dataset

    if task == "decision":
        example = make_walk_dataset(2, num_decisions=3, filler_length=4, seed=5)[0]
    else:
        example = make_running_sum_dataset(2, seed=5)[0]
    command = segments_command(task, tiny_dir, example, 0.35)
    assert command[:4] == ["trl-sae", "segments", "--model", str(tiny_dir)] and command[-2:] == ["-p", "0.35"]
    prompt, text = command[command.index("--prompt") + 1], command[command.index("--text") + 1]
    assert prompt == example["prompt"][-1]["content"]
    if task == "decision":
        # The old hint gave every task the running sums' "Add: 3 5 2" / "3+5=8".
        start, tag = example["start"], example["tag"]
        assert prompt == f"Walk 3 from {start} pass {tag}"
        door = text[text.index(">") + 1]
        assert text == f"1.{tag}:{start}>{door} walk at {door}" and door != start and door in example["doors"]
        assert decision_char_positions(text) == [text.index(">") + 1]
    else:
        first, second = example["terms"][:2]
        assert prompt.startswith("Add: ") and text == f"{first}+{second}={first + second}"
    code, out, err = run(capsys, *command[1:], "--no-color", "--html", str(tmp_path / "seg.html"))
    assert code == 0, err
    assert out.splitlines()[0].startswith(f"[1] {len(text)} tokens")  # one token per character


def test_demo_quick_runs_end_to_end(capsys, tmp_path):
    out_dir = tmp_path / "demo"
    code, out, err = run(capsys, "demo", "--quick", "--output-dir", str(out_dir), "--no-progress")
    assert code == 0, err
    results = json.loads((out_dir / "results.json").read_text())
    assert results["estimator"] == "sae" and 0.0 <= results["accuracy_after"] <= 1.0
    assert results["curves"]["training reward (mean per step)"]
    page = (out_dir / "report.html").read_text()
    assert 'class="seg ' in page and "data:image/png;base64," in page
    assert (out_dir / "model" / "config.json").is_file()
    assert (out_dir / "model" / "value_model" / "config.json").is_file()
    assert "held-out accuracy" in out
    # It ends with a segments command on the trained model; that command runs.
    hint = out.strip().splitlines()[-1].split("(try: ", 1)[1].rstrip(")")
    argv = shlex.split(hint)
    assert argv[:4] == ["trl-sae", "segments", "--model", str(out_dir / "model")]
    assert run(capsys, *argv[1:], "--no-color", "--html", str(tmp_path / "seg.html"))[0] == 0


def _gym_answers(limit: int, seed: int = 0) -> dict[str, str]:
    """The reasoning-gym problems `trl-sae eval --datasets reasoning_gym:basic_arithmetic` generates: question -> answer."""
    from trl_sae.gym import HELD_OUT_SEED_OFFSET, load_reasoning_gym

    rows = load_reasoning_gym(
        "basic_arithmetic", size=limit, seed=seed + HELD_OUT_SEED_OFFSET, config=GYM_CONFIG
    )
    return dict(zip(rows["question"], rows["answer"], strict=True))


GYM_CONFIG = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}


def test_eval_reads_reasoning_gym_tasks_and_compares_with_a_baseline_model(
    capsys, tmp_path, tiny_dir, tokenizer, monkeypatch
):
    """Issue 29: `trl-sae eval --datasets reasoning_gym:basic_arithmetic` failed with "unknown math dataset".
    The model answers problems 0-5 right, the baseline 4-7: the paired difference and McNemar's p are of the
    same 10 problems (model alone right on 0-3, baseline alone on 6-7)."""
    pytest.importorskip("reasoning_gym")
    baseline_dir = tmp_path / "baseline"
    shutil.copytree(tiny_dir, baseline_dir)
    answers = _gym_answers(10)
    right = {str(tiny_dir): range(0, 6), str(baseline_dir): range(4, 8)}

    def fake_generate(
        model, tokenizer, prompts, max_new_tokens, temperature, num_samples, batch_size, progress
    ):
        assert temperature == 0.0 and num_samples == 1
        solved = right[model.config._name_or_path]
        questions = [prompt[-1]["content"] for prompt in prompts]
        texts = []
        for i, question in enumerate(questions):
            (answer,) = [a for q, a in answers.items() if q in question]
            texts.append(f"<answer>{answer if i in solved else int(answer) + 1}</answer>")
        return texts, [[1, 2, 3]] * len(texts)

    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    output = tmp_path / "eval.json"
    argv = ["eval", "--model", str(tiny_dir), "--baseline-model", str(baseline_dir), "--no-progress"]
    argv += [
        "--datasets",
        "reasoning_gym:basic_arithmetic",
        "--limit",
        "10",
        "--gym-config",
        json.dumps(GYM_CONFIG),
    ]
    code, out, err = run(capsys, *argv, "--output", str(output))
    assert code == 0, err
    payload = json.loads(output.read_text())
    result = payload["results"]["reasoning_gym:basic_arithmetic"]
    assert result["accuracy"] == pytest.approx(0.6) and result["per_problem"] == [1.0] * 6 + [0.0] * 4
    assert payload["baseline_results"]["reasoning_gym:basic_arithmetic"]["accuracy"] == pytest.approx(0.4)
    paired = result["vs_baseline"]
    assert (paired["b"], paired["c"], paired["n"]) == (2, 4, 10)
    assert paired["difference"] == pytest.approx(0.2)
    assert paired["p_value"] == pytest.approx(2 * (1 + 6 + 15) / 64)  # two-sided Binomial(6, 1/2) tail of 2
    assert "exact McNemar test" in out


def test_eval_on_a_recipes_held_out_set_uses_its_reward(capsys, tmp_path, tiny_dir, monkeypatch):
    """--recipe: the held-out set `trl-sae train` builds for the real-model recipe (170 generated, the
    training questions removed: 100), graded by the recipe's reward (reasoning_gym), greedy."""
    pytest.importorskip("reasoning_gym")
    recipe = Path(__file__).resolve().parents[1] / "examples" / "real_model" / "smollm2_135m_gym_lora.yaml"
    seen = {}

    def fake_generate(
        model, tokenizer, prompts, max_new_tokens, temperature, num_samples, batch_size, progress
    ):
        seen.update(
            prompts=len(prompts),
            shots=sum(m["role"] == "assistant" for m in prompts[0]),
            tokens=max_new_tokens,
        )
        return ["<answer>0</answer>"] * len(prompts), [[1]] * len(prompts)

    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    code, out, err = run(capsys, "eval", "--model", str(tiny_dir), "--recipe", str(recipe), "--no-progress")
    assert code == 0, err
    assert seen == {"prompts": 100, "shots": 2, "tokens": 24}  # the recipe's response_length
    assert "reasoning_gym:basic_arithmetic (smollm2_135m_gym_lora.yaml)" in out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["-k", "4", "--temperature", "1", "--baseline-model", "m"],
            "--baseline-model compares one answer per problem; got -k 4",
        ),
        (
            ["--gym-config", "{}"],
            "--gym-config, --gym-few-shot and --gym-worked-steps apply to reasoning_gym:<task> datasets",
        ),
        (["--gym-worked-steps"], "--gym-worked-steps shapes the solved examples, but --gym-few-shot is 0"),
        (
            ["--datasets", "reasoning_gym:no_such_task"],
            "dataset 'reasoning_gym:no_such_task': reasoning-gym task",
        ),
        (
            ["--datasets", "reasoning_gym:basic_arithmetic", "--gym-config", "[1]"],
            "--gym-config: must be a JSON object",
        ),
    ],
)
def test_eval_refuses_bad_combinations_in_one_line(
    capsys, monkeypatch, tiny_dir, math_jsonl, extra, expected
):
    pytest.importorskip("reasoning_gym")

    def no_loading(*args, **kwargs):
        raise AssertionError("a dataset was loaded before the arguments were checked")

    monkeypatch.setattr("trl_sae.data.load_math_dataset", no_loading)  # refusals come first, from the names
    datasets = [] if "--datasets" in extra else ["--datasets", str(math_jsonl)]
    code, _, err = run(capsys, "eval", "--model", str(tiny_dir), *datasets, *extra)
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[0].startswith(f"trl-sae eval: error: {expected}")
