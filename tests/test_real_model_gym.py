"""benchmarks/real_model_gym.py's paired statistics: per-problem held-out results and the exact McNemar test of
each evaluation against step 0 (fast: a tiny model and a scripted reward; the real-model smoke run is in
tests/test_real_model.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.gym import ENTRY_COLUMN, load_reasoning_gym

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_model_gym.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("real_model_gym_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mcnemar_exact(bench):
    from _common import mcnemar_exact

    return mcnemar_exact


def test_mcnemar_counts_the_discordant_problems_and_gives_the_exact_p_value(mcnemar_exact):
    # 5 right both times, 10 fixed, none broken: p = 2 / 2^10
    result = mcnemar_exact([1] * 5 + [0] * 10, [1] * 5 + [1] * 10)
    assert (result["b"], result["c"], result["n"]) == (0, 10, 15)
    assert result["difference"] == pytest.approx(10 / 15)
    assert result["p_value"] == pytest.approx(2 / 1024)
    # 1 broken, 9 fixed, 20 wrong both times: p = 2 (1 + 10) / 2^10
    before = [1] + [0] * 9 + [0] * 20
    after = [0] + [1] * 9 + [0] * 20
    result = mcnemar_exact(before, after)
    assert (result["b"], result["c"]) == (1, 9)
    assert result["difference"] == pytest.approx(8 / 30)
    assert result["p_value"] == pytest.approx(22 / 1024)
    # as many broken as fixed, or nothing changed: no evidence either way
    assert mcnemar_exact([1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1])["p_value"] == pytest.approx(1.0)
    unchanged = mcnemar_exact([1, 0, 1], [1, 0, 1])
    assert (unchanged["b"], unchanged["c"], unchanged["p_value"], unchanged["difference"]) == (0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="same n >= 1 problems, got 3 and 2"):
        mcnemar_exact([1, 0, 1], [1, 0])


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_mcnemar_is_the_binomial_tail_of_the_discordant_pairs(mcnemar_exact, pairs):
    before = [old for old, _ in pairs]
    after = [new for _, new in pairs]
    result = mcnemar_exact(before, after)
    b, c = result["b"], result["c"]
    assert b == sum(old and not new for old, new in pairs) and c == sum(new and not old for old, new in pairs)
    # the paired difference is the difference of the two accuracies
    assert result["difference"] == pytest.approx(sum(after) / len(pairs) - sum(before) / len(pairs))
    # two-sided exact test at 1/2: twice the smaller tail, at most 1
    tail = sum(math.comb(b + c, k) for k in range(min(b, c) + 1)) / 2 ** (b + c)
    assert result["p_value"] == pytest.approx(min(1.0, 2 * tail))
    # swapping the evaluations swaps b and c and keeps p; problems right or wrong both times change nothing
    swapped = mcnemar_exact(after, before)
    assert (swapped["b"], swapped["c"]) == (c, b) and swapped["p_value"] == pytest.approx(result["p_value"])
    padded = mcnemar_exact(before + [True, False] * 7, after + [True, False] * 7)
    assert (padded["b"], padded["c"]) == (b, c) and padded["p_value"] == pytest.approx(result["p_value"])


def test_the_held_out_evaluation_keeps_each_problems_result_in_order(
    bench, tiny_model, tokenizer, monkeypatch
):
    import trl_sae.rewards.reasoning_gym as gym_reward

    held_out = load_reasoning_gym("basic_arithmetic", 7, seed=5, config=bench.TASK_CONFIG)
    questions = [json.loads(entry)["question"] for entry in held_out[ENTRY_COLUMN]]

    def every_third_problem(prompts, completions, completion_ids, **columns):
        # scripted grader: problems 0, 3, 6 are right, whatever the tiny model wrote
        return [
            1.0 if questions.index(json.loads(e)["question"]) % 3 == 0 else 0.0 for e in columns[ENTRY_COLUMN]
        ]

    assert len(set(questions)) == len(questions)
    monkeypatch.setattr(gym_reward, "reasoning_gym_accuracy", every_third_problem)
    point = bench.held_out_accuracy(tiny_model, tokenizer, held_out, max_new_tokens=2)
    assert point["correct"] == [1, 0, 0, 1, 0, 0, 1]
    assert point["n"] == 7 and point["accuracy"] == pytest.approx(3 / 7)
    assert point["low"] < 3 / 7 < point["high"]


def test_each_evaluation_after_step_0_is_paired_against_it(bench, monkeypatch):
    args = bench.parse_args(["--steps", "4", "--eval-every", "2"])
    results = {0: [1, 1, 0, 0, 0, 0, 0, 0], 2: [1, 0, 1, 1, 0, 0, 0, 0], 4: [1, 1, 1, 1, 1, 1, 0, 0]}
    steps = iter(sorted(results))
    monkeypatch.setattr(
        bench, "held_out_accuracy", lambda *_: bench.accuracy_point([bool(v) for v in results[next(steps)]])
    )
    recorder = bench._Recorder(args, lambda: None, None, None)
    recorder.evaluate(0)
    for step in (1, 2, 3, 4):
        recorder.step_begin()
        recorder.step_end(step)
    assert [point["step"] for point in recorder.curve] == [0, 2, 4]
    assert "vs_step_0" not in recorder.curve[0]
    at_2, at_4 = recorder.curve[1]["vs_step_0"], recorder.curve[2]["vs_step_0"]
    assert (at_2["b"], at_2["c"], at_2["difference"]) == (1, 2, pytest.approx(1 / 8))
    assert at_2["p_value"] == pytest.approx(1.0)  # 2 (1 + 3) / 8 = 1
    assert (at_4["b"], at_4["c"], at_4["difference"]) == (0, 4, pytest.approx(4 / 8))
    assert at_4["p_value"] == pytest.approx(2 / 16)
    assert recorder.curve[2]["correct"] == results[4] and recorder.curve[2]["accuracy"] == pytest.approx(
        6 / 8
    )


def test_a_timing_run_evaluates_nothing(bench, monkeypatch):
    args = bench.parse_args(["--steps", "3", "--eval-every", "0", "--skip-base-eval"])
    monkeypatch.setattr(bench, "held_out_accuracy", lambda *_: pytest.fail("--eval-every 0 evaluated"))
    recorder = bench._Recorder(args, lambda: None, None, None)
    for step in (1, 2, 3):
        recorder.step_begin()
        recorder.step_end(step)
    assert recorder.curve == [] and len(recorder.step_seconds) == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--eval-every", "-1"])


def test_saved_models_are_evaluated_and_paired_against_the_first(bench, monkeypatch):
    # --eval-models base out/: the recipe's saved output against the base model on the same problems
    per_model = {"base": [1, 0, 0, 1, 0, 0], "out": [1, 1, 1, 1, 0, 0]}
    monkeypatch.setattr(bench, "load_model_and_tokenizer", lambda name: (name, None))
    monkeypatch.setattr(bench, "datasets", lambda args: (None, None))
    monkeypatch.setattr(
        bench,
        "held_out_accuracy",
        lambda model, *_: bench.accuracy_point([bool(v) for v in per_model[model]]),
    )
    args = bench.parse_args(["--eval-models", "base", "out"])
    result = bench.evaluate_models(args, "python real_model_gym.py --eval-models base out")
    first, trained = result["evaluations"]
    assert (first["model"], trained["model"]) == ("base", "out") and "vs_first" not in first
    assert first["accuracy"] == pytest.approx(2 / 6) and trained["accuracy"] == pytest.approx(4 / 6)
    assert trained["vs_first"] == {"difference": pytest.approx(2 / 6), "b": 0, "c": 2, "p_value": 0.5, "n": 6}
    assert result["command"].endswith("--eval-models base out")


def test_a_step_0_evaluation_is_reused_only_for_the_same_held_out_problems(bench, tmp_path):
    base = {"step": 0, **bench.accuracy_point([True, False, True]), "seconds": 60.0}
    args = bench.parse_args(["--skip-base-eval", "--base-eval-from", str(tmp_path / "base.json")])
    settings = {name: getattr(args, name) for name in bench.HELD_OUT_SETTINGS}
    (tmp_path / "base.json").write_text(json.dumps({"settings": settings, "curve": [base]}))
    reused = bench.base_evaluation_from(tmp_path / "base.json", args)
    assert reused["correct"] == [1, 0, 1] and reused["from"] == str(tmp_path / "base.json")

    (tmp_path / "other.json").write_text(json.dumps({"settings": {**settings, "seed": 7}, "curve": [base]}))
    with pytest.raises(SystemExit, match=r"its seed is 7, this run.s is 0.*--seed"):
        bench.base_evaluation_from(tmp_path / "other.json", args)
    (tmp_path / "old.json").write_text(
        json.dumps({"settings": settings, "curve": [{k: v for k, v in base.items() if k != "correct"}]})
    )
    with pytest.raises(SystemExit, match="no step-0 evaluation with per-problem results"):
        bench.base_evaluation_from(tmp_path / "old.json", args)
    with pytest.raises(
        SystemExit
    ):  # argparse: it replaces the step-0 evaluation, so it needs --skip-base-eval
        bench.parse_args(["--base-eval-from", str(tmp_path / "base.json")])


def test_a_sweep_runs_arms_x_seeds_once_each_and_a_rerun_skips_finished_runs(bench, monkeypatch, tmp_path):
    """--arms x --seeds through the one runner: each run's JSON under runs/ when it ends, reused on a rerun."""
    ran = []

    def fake_run(args, command):
        ran.append((args.trainer, args.estimator, args.seed))
        curve = [{"step": 0, **bench.accuracy_point([True, False])}]
        curve.append({"step": 1, **bench.accuracy_point([True, True]), "vs_step_0": {"p_value": 1.0}})
        return {"estimator": args.estimator, "seconds_per_step": 2.0, "curve": curve, "command": command}

    monkeypatch.setattr(bench, "run", fake_run)
    argv = ["--smoke", "--arms", "sae:sae", "trl-grpo", "--seeds", "3", "4", "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    assert ran == [("sae", "sae", 3), ("trl-grpo", "grpo", 3), ("sae", "sae", 4), ("trl-grpo", "grpo", 4)]
    names = sorted(path.name.rsplit("-", 1)[0] for path in (tmp_path / "runs").glob("*.json"))
    assert names == ["sae-sae-seed3", "sae-sae-seed4", "trl-grpo-seed3", "trl-grpo-seed4"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["arm"], r["seed"]) for r in results["runs"]] == [
        ("sae:sae", 3),
        ("trl-grpo", 3),
        ("sae:sae", 4),
        ("trl-grpo", 4),
    ]
    markdown = (tmp_path / "results.md").read_text()
    assert "| sae:sae | 3 | 0.500 | 1.000 (1) | 1 | 2.0 |" in markdown
    assert "## Command" in markdown and "--arms sae:sae trl-grpo" in markdown and "## Environment" in markdown

    ran.clear()
    assert bench.main(argv) == 0
    assert ran == [] and (tmp_path / "run.log").read_text().count(": reused ") == 4
    # Another setting is another run: nothing is reused.
    assert bench.main([*argv, "--learning-rate", "1e-3"]) == 0
    assert len(ran) == 4 and len(list((tmp_path / "runs").glob("*.json"))) == 8


def test_a_sweep_refuses_bad_arms_and_single_run_outputs(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "sae", "--output-dir", str(tmp_path)])  # sae needs :ESTIMATOR
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "sae:sae"])  # no --output-dir
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "sae:sae", "--output-dir", str(tmp_path), "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit):
        bench.parse_args(["--seeds", "1", "2"])  # a sweep's flag without --arms


@pytest.mark.parametrize(
    ("argv", "critic"),
    [
        (["--estimator", "sae"], "SharedBaseCritic"),
        (["--estimator", "sae", "--critic", "head"], "HeadCritic"),
        (["--estimator", "grpo", "--critic", "head"], "PolicyAndCritic"),  # GRPO trains no critic
    ],
)
def test_critic_selects_the_head_critic_and_defaults_keep_sweep_names(bench, tokenizer, argv, critic):
    from datasets import Dataset

    from trl_sae.demo.tiny import build_tiny_qwen3

    args = bench.parse_args(["--smoke", *argv])
    train = Dataset.from_dict({"prompt": [f"Q{i}:" for i in range(8)], ENTRY_COLUMN: ["{}"] * 8})
    trainer, _ = bench.build_trl_sae(args, build_tiny_qwen3(tokenizer, seed=0), tokenizer, train)
    assert type(trainer.accelerator.unwrap_model(trainer.model)).__name__ == critic
    # runs finished before --critic existed keep their file names under the default
    args.output_dir = Path("sweep")
    default = bench.run_path(args, "sae:sae", 0)
    legacy = {k: v for k, v in vars(args).items() if k not in ("critic", "value_head_trunk_grad_scale")}
    if "--critic" not in argv:
        assert default == bench.run_path(argparse.Namespace(**legacy), "sae:sae", 0)
    else:
        assert default != bench.run_path(argparse.Namespace(**legacy), "sae:sae", 0)
