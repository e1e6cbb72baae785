"""benchmarks/real_model_gym.py's paired statistics: per-problem held-out results and the exact McNemar test of
each evaluation against step 0 (fast: a tiny model and a scripted reward; the real-model smoke run is in
tests/test_real_model.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
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
    monkeypatch.setattr(bench, "datasets", lambda args: (None, None, {}))
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
    base = {"step": 0, **bench.accuracy_point([True, False, True]), "engine": bench.EVAL_ENGINE}
    args = bench.parse_args(["--skip-base-eval", "--base-eval-from", str(tmp_path / "base.json")])
    settings = {name: getattr(args, name) for name in bench.HELD_OUT_SETTINGS}
    data = {"problem_seed": bench.problem_seed(args.seed)}
    (tmp_path / "base.json").write_text(json.dumps({"settings": settings, "data": data, "curve": [base]}))
    reused = bench.base_evaluation_from(tmp_path / "base.json", args)
    assert reused["correct"] == [1, 0, 1] and reused["from"] == str(tmp_path / "base.json")

    other = {"settings": {**settings, "response_length": 7}, "data": data, "curve": [base]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"its response_length is 7, this run.s is 24.*--response-length"):
        bench.base_evaluation_from(tmp_path / "other.json", args)
    # issue 21's files: nearby problem seeds and a vLLM evaluation for some arms: never a baseline now
    (tmp_path / "v1.json").write_text(json.dumps({"settings": settings, "curve": [base]}))
    with pytest.raises(SystemExit, match="before the problem seeds and the evaluation engine were fixed"):
        bench.base_evaluation_from(tmp_path / "v1.json", args)
    (tmp_path / "old.json").write_text(
        json.dumps(
            {"settings": settings, "data": data, "curve": [{k: v for k, v in base.items() if k != "correct"}]}
        )
    )
    with pytest.raises(SystemExit, match="no step-0 evaluation with per-problem results"):
        bench.base_evaluation_from(tmp_path / "old.json", args)
    with pytest.raises(
        SystemExit
    ):  # argparse: it replaces the step-0 evaluation, so it needs --skip-base-eval
        bench.parse_args(["--base-eval-from", str(tmp_path / "base.json")])


def test_a_sweep_runs_arms_x_seeds_once_each_and_a_rerun_skips_finished_runs(bench, monkeypatch, tmp_path):
    """--arms x --seeds through the one runner: each run's JSON under runs/ when it ends, reused on a rerun."""
    ran, evaluated = [], []

    def fake_base(args, command):
        evaluated.append(args.seed)
        correct = [args.seed == 3, False]  # the seeds' base evaluations differ
        return {"arm": "base", "curve": [{"step": 0, **bench.accuracy_point(correct)}], "seed": args.seed}

    def fake_run(args, command):
        ran.append((args.trainer, args.estimator, args.seed))
        # Every arm takes its seed's one base evaluation instead of evaluating step 0 itself.
        assert args.skip_base_eval and args.base_eval_from.parent == tmp_path / "base"
        base = json.loads(args.base_eval_from.read_text())
        assert base["seed"] == args.seed
        curve = [{**base["curve"][0], "from": str(args.base_eval_from)}]
        curve.append({"step": 1, **bench.accuracy_point([True, True]), "vs_step_0": {"p_value": 1.0}})
        return {"estimator": args.estimator, "seconds_per_step": 2.0, "curve": curve, "command": command}

    monkeypatch.setattr(bench, "evaluate_base", fake_base)
    monkeypatch.setattr(bench, "run", fake_run)
    argv = ["--smoke", "--arms", "sae:sae", "trl-grpo", "--seeds", "3", "4", "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    assert ran == [("sae", "sae", 3), ("trl-grpo", "grpo", 3), ("sae", "sae", 4), ("trl-grpo", "grpo", 4)]
    assert evaluated == [3, 4] and len(list((tmp_path / "base").glob("seed*.json"))) == 2
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
    assert "| trl-grpo | 4 | 0.000 | 1.000 (1) | 1 | 2.0 |" in markdown
    assert "## Command" in markdown and "--arms sae:sae trl-grpo" in markdown and "## Environment" in markdown

    ran.clear()
    assert bench.main(argv) == 0
    assert ran == [] and (tmp_path / "run.log").read_text().count(": reused ") == 6
    # Another training setting is another run, evaluated against the same base evaluations (the same held-out
    # problems and decoding); another held-out set is evaluated again.
    assert bench.main([*argv, "--learning-rate", "1e-3"]) == 0
    assert len(ran) == 4 and len(list((tmp_path / "runs").glob("*.json"))) == 8 and evaluated == [3, 4]
    assert bench.main([*argv, "--few-shot", "1"]) == 0
    assert evaluated == [3, 4, 3, 4]


def test_each_result_names_the_commit_it_ran_and_any_uncommitted_code(bench, tmp_path):
    """Runs of one sweep can span commits (its runs are named by their settings only): each file records the
    commit and lists the code files changed but not committed, and only those."""
    import subprocess

    from _common import code_version

    def git(*arguments):
        return subprocess.run(
            ["git", "-C", str(tmp_path), *arguments], capture_output=True, text=True, check=True
        )

    git("init", "-q")
    for key, value in (("user.email", "t@example.com"), ("user.name", "t")):
        git("config", key, value)
    for name in ("trl_sae/core/math.py", "benchmarks/run.py", "benchmarks/README.md", "tests/test_x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert code_version(tmp_path / "benchmarks") == {"commit": head, "uncommitted": []}
    for name in ("trl_sae/core/math.py", "benchmarks/run.py", "benchmarks/README.md", "tests/test_x.py"):
        (tmp_path / name).write_text("x = 2\n")
    (tmp_path / "benchmarks" / "new.py").write_text(
        ""
    )  # untracked: not code any run imported from the commit
    # from any folder of the checkout: docs and tests are not the code a run ran
    expected = {"commit": head, "uncommitted": ["benchmarks/run.py", "trl_sae/core/math.py"]}
    assert code_version(tmp_path / "trl_sae" / "core") == expected
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    assert code_version(outside) == {"commit": None, "uncommitted": None}

    args = bench.parse_args(["--smoke"])
    header = bench.result_header(args, "python benchmarks/real_model_gym.py --smoke", {})
    assert header["code"] == code_version() and len(header["code"]["commit"]) == 40


def test_a_result_names_the_code_its_process_started_with(bench, monkeypatch, tmp_path):
    """A sweep runs for hours: a commit made meanwhile must not be named as the code of runs that never ran it."""
    import _common

    versions = iter([{"commit": "a" * 40, "uncommitted": []}, {"commit": "b" * 40, "uncommitted": ["x.py"]}])
    monkeypatch.setattr(_common, "code_version", lambda root=None: next(versions))
    _common.code_at_start.cache_clear()

    def run(args, command):
        _common.code_version()  # the checkout moves on while the run trains: someone commits
        return bench.result_header(args, command, {})

    monkeypatch.setattr(bench, "run", run)
    out = tmp_path / "run.json"
    try:
        assert bench.main(["--smoke", "--out", str(out)]) == 0
        assert json.loads(out.read_text())["code"] == {"commit": "a" * 40, "uncommitted": []}
        assert bench.result_header(bench.parse_args(["--smoke"]), "", {})["code"]["commit"] == "a" * 40
    finally:
        _common.code_at_start.cache_clear()


def test_a_sweep_refuses_bad_arms_and_single_run_outputs(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "sae", "--output-dir", str(tmp_path)])  # sae needs :ESTIMATOR
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "sae:sae"])  # no --output-dir
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "sae:sae", "--output-dir", str(tmp_path), "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit):
        bench.parse_args(["--seeds", "1", "2"])  # a sweep's flag without --arms


# --------------------------------------------------------------------------------------------------
# Issue 31: a fair, resumable comparison (prompt order, held-out set, diagnostics, seeds, resolution)
# --------------------------------------------------------------------------------------------------
TINY_SWEEP = [
    "--tune", "--seeds", "101", "--steps", "3", "--prompts-per-step", "1", "--num-generations", "2",
    "--ppo-epochs", "1", "--response-length", "6", "--train-size", "2", "--eval-size", "2",
    "--eval-every", "3", "--few-shot", "0", "--threads", "1",
]  # fmt: skip


def test_every_arm_trains_on_the_same_prompts_in_order_and_keeps_its_diagnostics(
    bench, tokenizer, monkeypatch, tmp_path
):
    """Issue 31.2/31.4/31.5 on the tiny model: trl-sae (SAE) and TRL's GRPOTrainer train on the training set's
    prompts in its own order, epoch after epoch (3 steps over 2 prompts: q0, q1, q0; before, trl-sae shuffled
    with randperm and GRPOTrainer with its RepeatSampler); each run's JSON, written when it ends, keeps the
    per-step diagnostics; the same command again reuses both runs."""
    from trl_sae.demo.tiny import build_tiny_qwen3

    monkeypatch.setattr(
        bench, "load_model_and_tokenizer", lambda name: (build_tiny_qwen3(tokenizer), tokenizer)
    )
    argv = [*TINY_SWEEP, "--arms", "sae:sae", "trl-grpo", "--output-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    runs = {
        json.loads(path.read_text())["arm"]: json.loads(path.read_text())
        for path in (tmp_path / "runs").glob("*.json")
    }
    assert sorted(runs) == ["sae:sae", "trl-grpo"]
    (base_file,) = (tmp_path / "base").glob("seed101-*.json")
    base = json.loads(base_file.read_text())
    assert base["data"]["held_out_problems"] == 2 and len(base["curve"][0]["correct"]) == 2

    train, _, _ = bench.datasets(bench.arm_args(bench.parse_args(argv), "sae:sae", 101))
    q0, q1 = train["question"]
    expected = bench.prompt_order([[q0], [q1], [q0]])
    for run_ in runs.values():
        assert run_["prompt_order"] == expected
        assert run_["data"]["held_out_in_train"] == 0 and run_["data"]["held_out_problems"] == 2
        assert [point["step"] for point in run_["curve"]] == [0, 3]
        assert run_["curve"][1]["engine"] == bench.EVAL_ENGINE
        # step 0 is the seed's one evaluation of the base model, shared by both arms
        assert run_["curve"][0]["from"] == str(base_file)
        assert run_["curve"][0]["correct"] == base["curve"][0]["correct"]
        diagnostics = run_["diagnostics"]
        assert set(diagnostics) == {"step", *bench.DIAGNOSTICS} and diagnostics["step"] == [1, 2, 3]
        for name in ("reward", "response_length", "entropy", "clip_fraction"):
            assert all(math.isfinite(value) for value in diagnostics[name]), name
        assert all(0 < length <= 6 for length in diagnostics["response_length"])
    sae = runs["sae:sae"]["diagnostics"]
    for name in (
        "approx_kl",
        "explained_variance",
        "value_loss",
        "boundaries_per_completion",
        "mean_segment_length",
    ):
        assert all(math.isfinite(value) for value in sae[name]), name
        assert runs["trl-grpo"]["diagnostics"][name] == [None] * 3  # GRPOTrainer logs no such thing
    report = (tmp_path / "results.md").read_text()
    assert "Every arm of each seed trained on the same prompts" in report
    assert "| arm | seeds | gain SD |" in report and "| arm | runs | boundaries per completion |" in report
    bench.plot(sorted((tmp_path / "runs").glob("*.json")), tmp_path / "curves.png")  # accuracy and EV per arm
    assert (tmp_path / "curves.png").stat().st_size > 10_000

    monkeypatch.setattr(bench, "run", lambda *_: pytest.fail("a finished run was trained again"))
    assert bench.main(argv) == 0
    assert (tmp_path / "run.log").read_text().count(": reused ") == 3  # the base evaluation and both runs


def test_only_arms_that_train_a_critic_get_an_explained_variance_curve(bench):
    # trl-sae's GRPO logs an explained variance of 0 every step: plotted, it read as a critic that learns nothing
    assert bench.has_critic({"trainer": "sae", "estimator": "sae"})
    assert bench.has_critic({"trainer": "sae", "estimator": "mc"})
    assert not bench.has_critic({"trainer": "sae", "estimator": "grpo"})
    assert not bench.has_critic({"trainer": "trl-grpo", "estimator": "grpo"})
    assert bench.has_critic({"estimator": "gae"})  # files from before --trainer: trl-sae's


def test_held_out_problems_are_exactly_eval_size_none_in_training_and_seeds_draw_apart(bench):
    args = bench.parse_args(["--seed", "3"])
    train, held_out, data = bench.datasets(args)
    assert len(train) == 640 and len(held_out) == 500 >= bench.MIN_SWEEP_EVAL_SIZE
    assert not set(train["question"]) & set(held_out["question"])
    assert data["held_out_in_train"] == 0 and data["held_out_problems"] == 500
    assert data["problem_seed"] == 3 * bench.PROBLEM_SEED_STRIDE
    # reasoning-gym seeds row i with seed + i: nearby seeds used to train on the same problems, a row apart
    next_train, _, _ = bench.datasets(bench.parse_args(["--seed", "4"]))
    shifted = sum(a == b for a, b in zip(train["question"][1:], next_train["question"]))
    assert shifted < 20  # chance repeats only (~10^4 two-number sums)
    # a problem space too small for a disjoint held-out set is refused, not silently cut
    small = ["--task-config", json.dumps({**bench.TASK_CONFIG, "max_digits": 1}), "--train-size", "40"]
    with pytest.raises(SystemExit, match="problem space is too small"):
        bench.datasets(bench.parse_args(small))


def test_the_long_task_has_worked_steps_and_a_longer_budget(bench):
    args = bench.parse_args(["--long-task", "--few-shot", "2", "--train-size", "3", "--eval-size", "2"])
    assert args.task_config == bench.LONG_TASK_CONFIG and args.response_length == 128
    train, _, _ = bench.datasets(args)
    example = train[0]["prompt"][1]["content"].split("\n")  # the first worked example's answer turn
    # one addition a line (2-3 of them: 3-4 numbers), then the answer
    assert 3 <= len(example) <= 4 and example[-1].startswith("<answer>")
    assert all(re.fullmatch(r"-?\d+ \+ \d+ = -?\d+", line) for line in example[:-1]), example
    assert bench.parse_args([]).response_length == 24
    with pytest.raises(SystemExit):
        bench.parse_args(["--long-task", "--task-config", "{}"])


def test_a_pretrained_critic_and_its_layer_are_critic_settings(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--value-head-layer", "15"])  # the shared-base critic reads no layer
    with pytest.raises(SystemExit):
        bench.parse_args(["--value-pretrain-path", str(tmp_path / "missing")])
    sweep = ["--arms", "sae:sae", "sae:grpo", "--tune", "--output-dir", str(tmp_path), "--critic", "head"]
    plain = bench.parse_args(sweep)
    loaded = bench.parse_args([*sweep, "--value-head-layer", "15", "--value-pretrain-path", str(tmp_path)])
    assert (loaded.value_head_layer, loaded.value_pretrain_path) == (15, tmp_path)
    # another starting critic is another run: the name says so; without the flags, the name is as before
    assert bench.run_path(plain, "sae:sae", 100) != bench.run_path(loaded, "sae:sae", 100)
    legacy = {
        k: v
        for k, v in vars(plain).items()
        if k not in ("worked_steps", "value_head_layer", "value_pretrain_path")
    }
    assert bench.run_path(plain, "sae:sae", 100) == bench.run_path(
        argparse.Namespace(**legacy), "sae:sae", 100
    )


def test_critic_arms_load_the_pretrained_critic_and_the_others_have_none(bench, monkeypatch, tmp_path):
    from types import SimpleNamespace

    monkeypatch.setattr(
        bench,
        "build_trainer",
        lambda cls, config, *rest, **extra: SimpleNamespace(args=config, rollouts=None),
    )
    monkeypatch.setattr(bench, "train_in_dataset_order", lambda rollouts: None)
    argv = ["--critic", "head", "--value-head-layer", "15", "--value-pretrain-path", str(tmp_path)]
    configs = {
        estimator: bench.build_trl_sae(
            bench.parse_args([*argv, "--estimator", estimator]), None, None, [], []
        )[0].args
        for estimator in ("sae", "gae", "grpo")
    }
    assert [(c.value_head_layer, c.value_pretrain_path) for c in configs.values()] == [
        (15, str(tmp_path)),
        (15, str(tmp_path)),
        (None, None),  # no critic: nothing to read a layer or to load (the trainer refuses either)
    ]


def test_worked_steps_on_another_chain_and_the_base_evaluation_it_keys(bench, tmp_path):
    three_digits = {**bench.LONG_TASK_CONFIG, "min_terms": 3, "max_terms": 3, "max_digits": 1}
    argv = ["--task-config", json.dumps(three_digits), "--train-size", "3", "--eval-size", "2"]
    plain, worked = bench.parse_args(argv), bench.parse_args([*argv, "--worked-steps"])
    assert (plain.worked_steps, worked.worked_steps, bench.parse_args(["--long-task"]).worked_steps) == (
        False,
        True,
        True,
    )
    lines = bench.datasets(worked)[0][0]["prompt"][1]["content"].split("\n")
    assert len(lines) == 3 and all(re.fullmatch(r"\d+ \+ \d \= \d+", line) for line in lines[:2]), lines
    assert len(bench.datasets(plain)[0][0]["prompt"][1]["content"].split("\n")) == 2  # one line, the answer
    # other few-shot examples are other held-out prompts: another step-0 evaluation; the long task's stays
    sweep = ["--arms", "sae:sae", "--tune", "--output-dir", str(tmp_path)]
    assert bench.base_evaluation_path(bench.parse_args([*argv, *sweep]), 100) != bench.base_evaluation_path(
        bench.parse_args([*argv, *sweep, "--worked-steps"]), 100
    )
    # the long task's digest is the one its sweeps kept before the flag existed (no worked_steps key)
    import _sweep

    long_args = bench.parse_args(["--long-task", *sweep])
    data = {name: getattr(long_args, name) for name in bench.HELD_OUT_SETTINGS if name != "seed"}
    digest = _sweep.run_fingerprint({**data, "engine": bench.EVAL_ENGINE, "model": bench.MODEL}, ())
    assert bench.base_evaluation_path(long_args, 100).name == f"seed100-{digest}.json"


def test_every_arm_is_evaluated_by_the_same_greedy_generate(bench, monkeypatch):
    """Issue 31.2: with vLLM rollouts the evaluation used to run on vLLM (trl-sae only) and on transformers
    for GRPOTrainer; now every arm's policy goes through held_out_accuracy, at --response-length tokens."""
    calls = []
    monkeypatch.setattr(
        bench,
        "held_out_accuracy",
        lambda model, tokenizer, held_out, tokens: (
            calls.append((model, tokens)) or bench.accuracy_point([True])
        ),
    )
    args = bench.parse_args(["--use-vllm", "--long-task"])
    bench._Recorder(args, lambda: "policy", None, None).evaluate(0)
    assert calls == [("policy", 128)]


def test_sweeps_keep_tuning_and_fresh_seeds_apart(bench, tmp_path):
    out = ["--output-dir", str(tmp_path)]
    assert bench.parse_args(["--arms", "all", *out]).seeds == list(range(8))
    assert bench.parse_args(["--arms", "all", *out]).arms == list(bench.ALL_ARMS)
    assert bench.parse_args(["--arms", "sae:sae", "--tune", *out]).seeds == [100, 101, 102, 103]
    for bad in (
        ["--tune", "--seeds", "0"],  # a fresh seed is not tuned on
        ["--seeds", "100"],  # a tuning seed is not fresh
        ["--eval-size", "100"],  # a fresh sweep resolves with >= 500 problems
        ["--skip-base-eval"],  # every run's step 0 is its paired baseline
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(["--arms", "sae:sae", *out, *bad])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tune"])  # a sweep's flag without --arms
    # --tune picks the seeds only: a run's fingerprint is its settings
    tuned = bench.parse_args(["--arms", "sae:sae", "--tune", *out])
    fresh = bench.parse_args(["--arms", "sae:sae", "--seeds", "7", *out])
    assert (
        bench.run_path(tuned, "sae:sae", 100).name.split("-")[-1]
        == bench.run_path(fresh, "sae:sae", 7).name.split("-")[-1]
    )


def test_diagnostics_average_grpotrainers_optimizer_steps_per_rollout(bench):
    history = [
        {
            "step": 1,
            "completions/mean_length": 10.0,
            "reward": 0.5,
            "entropy": 2.0,
            "clip_ratio/region_mean": 0.1,
        },
        {
            "step": 2,
            "completions/mean_length": 10.0,
            "reward": 0.5,
            "entropy": 1.0,
            "clip_ratio/region_mean": 0.3,
        },
        {
            "step": 3,
            "completions/mean_length": 20.0,
            "reward": 1.0,
            "entropy": 0.5,
            "clip_ratio/region_mean": 0.0,
        },
        {"train_runtime": 1.0, "step": 4},
    ]
    result = bench.diagnostics(history, "trl-grpo", per_rollout=2)
    assert result["step"] == [1, 2]
    assert result["entropy"] == [pytest.approx(1.5), pytest.approx(0.5)]
    assert result["clip_fraction"] == [pytest.approx(0.2), pytest.approx(0.0)]
    assert result["reward"] == [0.5, 1.0] and result["explained_variance"] == [None, None]
    sae = bench.diagnostics(
        [{"step": 1, "completions/mean_length": 9.0, "critic/explained_variance": 0.25}], "sae", 1
    )
    assert sae["explained_variance"] == [0.25] and sae["value_loss"] == [None]


def test_the_gain_table_gives_each_arms_gain_and_its_paired_difference_to_sae(bench):
    def run_(arm, seed, before, after):
        curve = [{"step": 0, "accuracy": before}, {"step": 40, "accuracy": after}]
        return {"arm": arm, "seed": seed, "curve": curve, "prompt_order": {"digest": f"d{seed}"}}

    sae_gains = [0.10, 0.04, 0.06, 0.08]
    grpo_gains = [0.02, 0.05, 0.01, 0.00]
    runs = [run_("sae:sae", s, 0.4, 0.4 + g) for s, g in enumerate(sae_gains)]
    runs += [run_("sae:grpo", s, 0.4, 0.4 + g) for s, g in enumerate(grpo_gains)]
    table = "\n".join(bench.gain_table(runs))
    assert "| sae:sae | 4 | +7.0 |" in table and "| 4 / 4 |" in table
    # grpo - sae per seed: -8, +1, -5, -8 points: mean -5.0, one win and three losses, sign test p = 0.625
    assert "| sae:grpo | 4 | +2.0 |" in table and "| 3 / 4 | -5.0 |" in table and "| 1 / 3 | 0.625 |" in table
    # one comparison: Holm leaves its p as it is, and p 0.625 resolves nothing whatever the interval
    assert "| 1 / 3 | 0.625 | 0.625 | no |" in table
    assert (
        "| sae:sae | 4 | +7.0 |" in table and "| 4 / 4 | | | | | | |" in table
    )  # SAE against itself: no test
    assert bench.sign_test([-0.08, 0.01, -0.05, -0.08]) == pytest.approx(0.625)
    assert bench.sign_test([0.0, 0.0]) == 1.0
    assert "same prompts" in bench.prompt_order_check(runs)
    runs[-1]["prompt_order"]["digest"] = "other"
    assert "differs between the arms of seeds [3]" in bench.prompt_order_check(runs)


def test_a_difference_is_resolved_only_with_an_interval_off_zero_and_a_holm_p_below_005(bench):
    """The registered rule on 8 seeds: a difference on all 8 (sign p 0.0078) survives Holm over two
    comparisons (0.0156); one on 7 of 8 (p 0.070) does not, however far its interval lies from 0."""

    def run_(arm, seed, gain):
        curve = [{"step": 0, "accuracy": 0.3}, {"step": 24, "accuracy": 0.3 + gain}]
        return {"arm": arm, "seed": seed, "curve": curve, "prompt_order": {"digest": f"d{seed}"}}

    sae = [0.10, 0.12, 0.14, 0.16, 0.10, 0.12, 0.14, 0.16]
    runs = [run_("sae:sae", s, g) for s, g in enumerate(sae)]
    runs += [run_("sae:gae", s, g - 0.05) for s, g in enumerate(sae)]  # 5 points below SAE on every seed
    runs += [run_("sae:mc", s, g - 0.05 + 0.06 * (s == 0)) for s, g in enumerate(sae)]  # above on seed 0
    rows = {line.split(" | ")[0][2:]: line for line in bench.gain_table(runs)[2:]}
    assert rows["sae:gae"].endswith("| 0 / 8 | 0.00781 | 0.0156 | yes |")
    assert rows["sae:mc"].endswith("| 1 / 7 | 0.0703 | 0.0703 | no |")


def test_the_realised_resolution_is_the_measured_spread_of_the_seeds_gains(bench):
    def run_(arm, seed, gain):
        curve = [{"step": 0, "accuracy": 0.3}, {"step": 24, "accuracy": 0.3 + gain}]
        return {"arm": arm, "seed": seed, "curve": curve}

    sae = [0.10, 0.14, 0.12, 0.16]
    gae = [0.09, 0.15, 0.10, 0.12]  # differences -1, +1, -2, -4 points: SD 2.08
    runs = [run_("sae:sae", s, g) for s, g in enumerate(sae)] + [
        run_("sae:gae", s, g) for s, g in enumerate(gae)
    ]
    runs.append(run_("sae:mc", 0, 0.1))  # one seed: no spread to measure
    rows = {line.split(" | ")[0][2:]: line for line in bench.realised_resolution_table(runs)[2:]}
    assert rows["sae:sae"] == "| sae:sae | 4 | 2.6 | | | |"  # SD of 10, 14, 12, 16 points
    # corr(sae, gae) = 0.683; the t half-width t(0.975, 3) x SD / sqrt(4) = 3.182 x 2.08 / 2 = 3.3
    assert rows["sae:gae"] == "| sae:gae | 4 | 2.6 | 0.68 | 2.1 | +-3.3 |"
    assert rows["sae:mc"] == "| sae:mc | 1 | n/a | | | |"


def test_the_diagnostics_table_gives_each_arms_range_of_run_medians_from_step_2(bench):
    def run_(arm, estimator, boundaries, explained_variance, trainer="sae"):
        steps = [1, 2, 3, 4]
        return {
            "arm": arm,
            "trainer": trainer,
            "estimator": estimator,
            "diagnostics": {
                "step": steps,
                "boundaries_per_completion": boundaries,
                "explained_variance": explained_variance,
            },
        }

    runs = [
        run_(
            "sae:sae", "sae", [9.0, 1.0, 2.0, 4.0], [-5.0, 0.1, 0.2, 0.3]
        ),  # medians 2.0 and 0.2 (step 1 left out)
        run_("sae:sae", "sae", [0.0, 3.0, 3.0, 3.0], [0.0, 0.4, 0.5, 0.6]),
        run_("sae:grpo", "grpo", [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]),  # EV 0 is logged, not a critic
        run_("trl-grpo", "grpo", [None] * 4, [None] * 4, trainer="trl-grpo"),
    ]
    header, _, *lines = bench.diagnostics_table(runs)
    names = header.strip("| ").split(" | ")
    rows = {line.split(" | ")[0][2:]: dict(zip(names, line.strip("| ").split(" | "))) for line in lines}
    assert rows["sae:sae"]["runs"] == "2"
    assert rows["sae:sae"]["boundaries per completion"] == "2.00 to 3.00"
    assert rows["sae:sae"]["explained variance"] == "0.200 to 0.500"
    assert rows["sae:grpo"]["boundaries per completion"] == "1.00"
    assert rows["sae:grpo"]["explained variance"] == "n/a"
    assert rows["trl-grpo"]["boundaries per completion"] == "n/a" and rows["trl-grpo"]["entropy"] == "n/a"


def test_the_stated_resolution_follows_from_issue_31s_spreads(bench):
    from scipy import stats

    r = bench.resolution(8, 500)
    gain_sd = math.sqrt(0.06**2 - 0.027**2 + 0.027**2 / 5)  # the evaluation noise at 500 of 100 problems
    t = stats.t.ppf(0.975, 7)
    assert r["gain_sd"] == pytest.approx(gain_sd) == pytest.approx(0.0549, abs=1e-4)
    assert r["gain_half_width"] == pytest.approx(t * gain_sd / math.sqrt(8))
    assert r["difference_half_width"] == pytest.approx(math.sqrt(2) * r["gain_half_width"])
    assert r["minimum_detectable_difference"] == pytest.approx((t + stats.t.ppf(0.8, 7)) * gain_sd / 2)
    # at 100 problems the spread is the issue's 6 points; correlated arms resolve smaller differences
    assert bench.resolution(8, 100)["gain_sd"] == pytest.approx(0.06)
    assert bench.resolution(8, 500, correlation=0.5)["difference_half_width"] == pytest.approx(
        r["gain_half_width"]
    )
    with pytest.raises(ValueError):
        bench.resolution(1, 500)


@settings(max_examples=40, deadline=None)
@given(seeds=st.integers(2, 40), eval_size=st.integers(50, 5000), correlation=st.floats(0.0, 0.9))
def test_more_seeds_or_problems_never_resolve_less(bench, seeds, eval_size, correlation):
    here = bench.resolution(seeds, eval_size, correlation=correlation)
    assert (
        bench.resolution(seeds + 1, eval_size, correlation=correlation)["minimum_detectable_difference"]
        < (here["minimum_detectable_difference"])
    )
    assert (
        bench.resolution(seeds, eval_size + 100, correlation=correlation)["gain_half_width"]
        < here["gain_half_width"]
    )


def test_every_arm_gets_the_same_schedule_and_loss_aggregation(bench, monkeypatch):
    """Issue 31.2: issue 21's runs decayed the lr to 0 over each run's own length and aggregated the loss
    differently (TRL's default vs trl-sae's); now one --lr-scheduler over the same rollouts for every arm,
    trl-sae's token-mean against GRPOTrainer's dapo, GRPOTrainer unshuffled."""
    from types import SimpleNamespace

    monkeypatch.setattr(
        bench,
        "build_trainer",
        lambda cls, config, *rest, **extra: SimpleNamespace(args=config, rollouts=None),
    )
    monkeypatch.setattr(bench, "train_in_dataset_order", lambda rollouts: None)
    argv = ["--lr-scheduler", "linear", "--steps", "12", "--ppo-epochs", "2", "--mini-batches", "1"]
    argv += ["--value-warmup-steps", "2"]
    configs = {}
    for trainer, estimator in (("sae", "sae"), ("sae", "grpo"), ("trl-grpo", "grpo")):
        args = bench.parse_args([*argv, "--trainer", trainer, "--estimator", estimator])
        build = bench.build_trl_grpo if trainer == "trl-grpo" else bench.build_trl_sae
        configs[f"{trainer}:{estimator}"] = build(args, None, None, None, [])[0].args
    sae, grpo, trl = configs["sae:sae"], configs["sae:grpo"], configs["trl-grpo:grpo"]
    assert {c.lr_scheduler_type.value for c in configs.values()} == {"linear"}
    assert {c.learning_rate for c in configs.values()} == {5e-4}
    # the decay spans the same 12 rollouts: trl-sae counts rollouts, GRPOTrainer its 2 optimizer steps each
    assert sae.max_steps == grpo.max_steps == 12 and trl.max_steps == 24
    assert sae.loss_agg_mode == grpo.loss_agg_mode == "token-mean" and trl.loss_type == "dapo"
    assert trl.shuffle_dataset is False and trl.steps_per_generation == trl.gradient_accumulation_steps
    assert (sae.value_warmup_steps, grpo.value_warmup_steps) == (2, 0)  # the critic-less arm has no warm-up


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
    trainer, _ = bench.build_trl_sae(args, build_tiny_qwen3(tokenizer, seed=0), tokenizer, train, [])
    assert type(trainer.accelerator.unwrap_model(trainer.model)).__name__ == critic
    # runs finished before --critic existed keep their file names under the default
    args.output_dir = Path("sweep")
    default = bench.run_path(args, "sae:sae", 0)
    legacy = {k: v for k, v in vars(args).items() if k not in ("critic", "value_head_trunk_grad_scale")}
    if "--critic" not in argv:
        assert default == bench.run_path(argparse.Namespace(**legacy), "sae:sae", 0)
    else:
        assert default != bench.run_path(argparse.Namespace(**legacy), "sae:sae", 0)


REPO = SCRIPT.parents[1]
SWEEP_RESULTS = sorted(
    path
    for folder in ("base", "runs")
    for path in (REPO / "benchmarks" / "results" / "real_model").glob(f"*/{folder}/*.json")
)


@pytest.mark.skipif(not SWEEP_RESULTS, reason="no committed issue-31 sweep result yet")
@pytest.mark.parametrize("path", SWEEP_RESULTS, ids=lambda path: str(path.relative_to(REPO)))
def test_the_command_in_each_committed_sweep_result_finds_it_again(bench, path):
    """Issue 31's sweep spans sessions: a run is skipped on a rerun only while its file name (a digest of every
    setting) comes out the same. A new option, or a changed default, renames every finished run, and a rerun
    would quietly start the whole sweep again: this pins the names of the runs already on main."""
    import shlex

    result = json.loads(path.read_text())
    argv = shlex.split(result["command"])[2:]  # "python benchmarks/real_model_gym.py ..."
    args = bench.parse_args(argv)
    args.output_dir = REPO / args.output_dir
    if result["arm"] == "base":
        assert bench.base_evaluation_path(args, result["seed"]) == path
    else:  # a run file keeps its seed under settings, and is named as run_sweep names it
        assert result["arm"] in args.arms
        assert bench.run_path(args, result["arm"], result["settings"]["seed"]) == path
