"""The decision task (trl_sae.demo.decision_task) and benchmarks/long_horizon.py's --smoke run."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from trl_sae.demo.decision_task import (
    DECISION_DEFAULTS,
    boundary_precision_recall,
    decision_char_positions,
    decision_token_positions,
    format_walk,
    make_walk_dataset,
    make_walk_splits,
    walk_length,
    walk_reward,
)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_horizon.py"


def _reward(texts, start, tag, k, f, doors="abcdefg"):
    n = len(texts)
    return walk_reward(
        completions=texts,
        start=[start] * n,
        tag=[tag] * n,
        doors=[doors] * n,
        num_decisions=[k] * n,
        filler_length=[f] * n,
    )


# --------------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------------
def test_walk_format_and_decision_positions_point_at_the_chosen_doors():
    text = format_walk("c", "4821", ["e", "k", "b"], filler_length=5)
    assert text == "1.4821:c>e walki at e\n2.4821:e>k walki at k\n3.4821:k>b walki at b\nEND b"
    positions = decision_char_positions(text)
    assert positions == [9, 31, 53]
    assert [text[p] for p in positions] == ["e", "k", "b"]
    assert walk_length(3, 5, 4) == len(text)
    # Malformed lines still have their decision located; lines that do not start like a step do not.
    assert decision_char_positions("1.12:a>b garbage\nnonsense\n2.12:b>x") == [7, 33]


def test_decision_token_positions_map_characters_to_tokens(tokenizer):
    text = format_walk("a", "123", ["b", "c"], filler_length=3)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # Char tokenizer: one token per character, so token index = character offset.
    assert decision_token_positions(tokenizer, ids) == decision_char_positions(text) == [8, 27]
    assert [text[p] for p in (8, 27)] == ["b", "c"]

    class TwoCharTokenizer:
        """Token i decodes to pieces[i]: decision tokens are found through multi-character tokens."""

        pieces = ("1.", "12", "3:", "a>", "b ", "xx")

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    # "1.123:a>b xx": the decision 'b' is character 8, inside token 4 ("b ").
    assert decision_token_positions(TwoCharTokenizer(), [0, 1, 2, 3, 4, 5]) == [4]


def test_walk_reward_is_one_only_for_a_well_formed_walk_that_never_stays():
    good = format_walk("c", "0042", ["e", "g", "e"], 4)
    assert _reward([good], "c", "0042", 3, 4) == [1.0]
    bad = {
        "stays in its room": format_walk("c", "0042", ["e", "e", "g"], 4),
        "door outside the set": format_walk("c", "0042", ["e", "z", "g"], 4),
        "too few steps": format_walk("c", "0042", ["e", "g"], 4),
        "wrong pass number": format_walk("c", "0043", ["e", "g", "e"], 4),
        "wrong final room": good.replace("END e", "END g"),
        "garbled filler": good.replace("walk", "wakl", 1),
        "wrong restated room": good.replace("at g", "at b", 1),
    }
    rewards = _reward(list(bad.values()), "c", "0042", 3, 4)
    assert rewards == [0.0] * len(bad), dict(zip(bad, rewards))
    # Chat-message completions, as TRL passes them.
    assert _reward([[{"role": "assistant", "content": good}]], "c", "0042", 3, 4) == [1.0]
    with pytest.raises(ValueError, match="start"):
        walk_reward(completions=[good])


def test_sloppy_teacher_success_rate_and_held_out_split():
    data = make_walk_dataset(2000, num_decisions=8, filler_length=4, teacher_error_rate=0.15, seed=3)
    # Each step is correct with probability 0.85, independently: 0.85 ** 8 = 0.272.
    assert sum(data["solution_is_correct"]) / len(data) == pytest.approx(0.85**8, abs=0.03)
    assert all(make_walk_dataset(50, filler_length=4, teacher_error_rate=0.0)["solution_is_correct"])
    splits = make_walk_splits(300, 100, filler_length=4, teacher_error_rate=0.15)
    train = set(zip(splits["train"]["start"], splits["train"]["tag"]))
    test = set(zip(splits["test"]["start"], splits["test"]["tag"]))
    assert len(test) == 100 and not train & test
    assert all(splits["test"]["solution_is_correct"])
    lengths = [len(s) for s in make_walk_dataset(20)["solution"]]
    assert (
        set(lengths) == {DECISION_DEFAULTS.completion_length} and DECISION_DEFAULTS.completion_length >= 150
    )


def test_boundary_precision_recall_on_a_hand_made_example():
    boundaries = [
        [False, True, False, True, True, False],  # boundaries at 1, 3, 4
        [True, False, False, False],  # boundary at 0
    ]
    decisions = [[1, 4, 5], [2]]
    result = boundary_precision_recall(boundaries, decisions)
    # Hits: 1 and 4 in the first completion; boundaries 4; decisions 4.
    assert result["true_positives"] == 2
    assert result["precision"] == pytest.approx(2 / 4)
    assert result["recall"] == pytest.approx(2 / 4)
    assert result["boundaries_per_completion"] == pytest.approx(2.0)
    # Lengths cut padding off: with 4 valid tokens per row, the first row keeps boundaries {1, 3} and
    # decision {1} (4 and 5 are padding), the second boundary {0} and decision {2}.
    tensor = torch.tensor(
        [[False, True, False, True, True, False], [True, False, False, False, False, False]]
    )
    cut = boundary_precision_recall(tensor, decisions, lengths=[4, 4])
    assert (cut["true_positives"], cut["boundaries"], cut["decisions"]) == (1, 3, 2)
    assert math.isnan(boundary_precision_recall([[False]], [[0]])["precision"])


# --------------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("long_horizon_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_paired_difference_and_auc(bench):
    result = bench.paired_difference([0.5, 0.6, 0.7], [0.4, 0.4, 0.6])
    assert result["mean"] == pytest.approx(0.1333333)
    assert result["per_seed"] == pytest.approx([0.1, 0.2, 0.1])
    # t interval: mean ± t(0.975, 2) * sd / sqrt(3) = 0.1333 ± 4.303 * 0.0577 / 1.732.
    assert result["t_ci"] == pytest.approx([0.1333333 - 0.1434218, 0.1333333 + 0.1434218], abs=1e-5)
    # Resampled means of {0.1, 0.2, 0.1} lie in [0.1, 0.2] (up to rounding).
    assert 0.1 - 1e-9 <= result["bootstrap_ci"][0] <= result["bootstrap_ci"][1] <= 0.2 + 1e-9
    assert math.isnan(bench.paired_difference([0.5], [0.4])["t_ci"][0])
    assert bench.curve_auc([0, 10, 20], [0.2, 0.4, 0.4]) == pytest.approx((3.0 + 4.0) / 20)


def test_smoke_run_writes_every_output(bench, tmp_path):
    results = bench.main(
        ["--smoke", "--output-dir", str(tmp_path), "--warm-start-dir", str(tmp_path / "warm")]
    )
    for name in (
        "results.json",
        "results.md",
        "command.txt",
        "run.log",
        "learning_curves.png",
        "paired_differences.png",
        "segmentation_precision_recall.png",
        "advantage_correlation_f2.png",
        "advantage_correlation_f6.json",
    ):
        assert (tmp_path / name).is_file(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["command"] == results["command"] and "--smoke" in saved["command"]
    assert [s["filler_length"] for s in saved["summaries"]] == [2, 6]
    assert len(saved["runs"]) == 2 * len(bench.ESTIMATORS)
    for summary in saved["summaries"]:
        assert [row["estimator"] for row in summary["rows"]] == list(bench.ESTIMATORS)
        assert {p["versus"] for p in summary["paired"]} == set(bench.ESTIMATORS) - {"sae"}
    for run in saved["runs"]:
        assert run["eval_steps"] == [0, 1, 2]
        assert set(run["final_segmentation"]) == {str(p) for p in bench.P_GRID}
    assert set(saved["correlation"]) == {"2", "6"}
    assert "warm start" in (tmp_path / "run.log").read_text()
    # The warm starts are cached by fingerprint: a second run reuses them.
    assert {w["reused"] for w in saved["warm_starts"].values()} == {False}
    dirs = sorted(p.name for p in (tmp_path / "warm").iterdir())
    assert len(dirs) == 2 and all(d.startswith("decision-f") for d in dirs)
    fingerprint = bench.warm_start_fingerprint(bench.smoke_settings(), 2)
    assert fingerprint["filler_length"] == 2 and fingerprint["task"] == "decision"

    # Every finished run is kept on disk: an interrupted sweep run again reuses them (and its warm starts)
    # instead of training them again, and its summaries are built from the same numbers.
    assert len(list((tmp_path / "runs").glob("*.json"))) == 2 * len(bench.ESTIMATORS)
    again = bench.main(
        [
            "--smoke",
            "--no-correlation",
            "--output-dir",
            str(tmp_path),
            "--warm-start-dir",
            str(tmp_path / "warm"),
        ]
    )
    assert len(re.findall(r"seed \d+: reused ", (tmp_path / "run.log").read_text())) == 2 * len(
        bench.ESTIMATORS
    )
    assert json.loads(json.dumps(again["runs"])) == json.loads(json.dumps(results["runs"]))
    # A changed PPO setting is a different run: nothing is reused.
    changed = bench.run_result_path(
        tmp_path, bench.replace(bench.smoke_settings(), learning_rate=1e-3), 2, "sae", 0
    )
    assert not changed.exists()
    # Run names are pinned: a sweep resumes by name, so a refactor must not move finished runs.
    assert bench.run_result_path(Path("o"), bench.Settings(), 8, "sae", 0) == Path(
        "o/runs/f8-sae-seed0-d053891e0a6e.json"
    )


# --------------------------------------------------------------------------------------------------
# Report and demo
# --------------------------------------------------------------------------------------------------
def test_report_outlines_decision_tokens_and_scores_the_segments(tmp_path):
    from trl_sae.demo.report import render_segments_html, write_html_report

    tokens = list("1.ab:a>b xx")
    boundaries = [False] * len(tokens)
    boundaries[7] = boundaries[9] = True  # one boundary on the decision 'b', one on filler
    page = render_segments_html(tokens, boundaries, decisions=[7])
    decision_spans = re.findall(r'<span class="([^"]*decision[^"]*)" title="([^"]*)">([^<]*)</span>', page)
    assert decision_spans == [
        ("tok boundary decision", "t=7 token=&#x27;b&#x27; (boundary) (decision token)", "b")
    ]
    # Without decisions nothing is marked.
    assert "decision" not in render_segments_html(tokens, boundaries)
    path = write_html_report(
        tmp_path / "r.html",
        "t",
        {},
        completions=[{"completion_tokens": tokens, "boundaries": boundaries, "decisions": [7]}],
    )
    text = path.read_text()
    assert "1 decision tokens, 1 of them boundaries (1/2 boundaries on decisions)" in text
    assert "true decision tokens" in text


def test_demo_task_decision_quick_marks_decisions_in_the_report(tmp_path):
    from trl_sae.cli.app import main

    out_dir = tmp_path / "demo"
    assert main(["demo", "--task", "decision", "--quick", "--output-dir", str(out_dir), "--no-progress"]) == 0
    results = json.loads((out_dir / "results.json").read_text())
    assert results["task"] == "decision" and 0.0 <= results["accuracy_after"] <= 1.0
    assert results["config"]["warm_start"]["num_decisions"] == 3
    page = (out_dir / "report.html").read_text()
    assert 'class="seg ' in page and "decision token" in page and "decision tokens," in page


def test_value_warmup_steps_reach_the_settings_and_are_checked(bench):
    settings = bench.settings_from_args(bench.parse_args(["--steps", "12", "--value-warmup-steps", "4"]))
    assert settings.value_warmup_steps == 4 and settings.steps == 12
    with pytest.raises(SystemExit, match="value-warmup-steps"):
        bench.settings_from_args(bench.parse_args(["--steps", "4", "--value-warmup-steps", "4"]))
    # A different warm-up is a different run: finished runs of the other setting are not reused.
    plain = bench.run_settings_fingerprint(bench.Settings())
    assert bench.run_settings_fingerprint(bench.replace(bench.Settings(), value_warmup_steps=4)) != plain


def test_extra_config_fields_reach_every_run_and_its_fingerprint_not_the_warm_start(bench):
    extra = {"positive_nll_coef": 4.0, "whiten_advantages": False}
    settings = bench.settings_from_args(bench.parse_args(["--extra", json.dumps(extra)]))
    assert settings.extra == extra
    plain = bench.settings_from_args(bench.parse_args([]))
    assert plain.extra == {}
    # Other trainer settings are other runs, on the same warm start.
    assert bench.run_settings_fingerprint(settings) != bench.run_settings_fingerprint(plain)
    assert bench.warm_start_fingerprint(settings, 8) == bench.warm_start_fingerprint(plain, 8)


def test_one_command_gives_every_filler_length_its_sft_budget(bench):
    """The default settings carry the per-length budgets (filler 32 needs 800 SFT steps), and the warm-start and
    run fingerprints equal those of the two-command form (`--sft-steps 800` for filler 32), so caches and saved
    runs of either form are reused by the other."""
    default = bench.settings_from_args(bench.parse_args([]))
    assert (default.sft_steps_for(8), default.sft_steps_for(32)) == (400, 800)
    explicit = bench.settings_from_args(bench.parse_args(["--filler-lengths", "32", "--sft-steps", "800"]))
    assert explicit.sft_steps_for(32) == 800 and explicit.sft_steps_for(8) == 800  # --sft-steps: every length
    assert bench.warm_start_fingerprint(default, 32) == bench.warm_start_fingerprint(explicit, 32)
    assert bench.warm_start_fingerprint(default, 32)["sft_steps"] == 800
    assert bench.warm_start_fingerprint(default, 8)["sft_steps"] == 400
    assert bench.run_result_path(Path("o"), default, 32, "sae", 0) == bench.run_result_path(
        Path("o"), bench.replace(explicit, filler_lengths=(8, 32)), 32, "sae", 0
    )
    assert bench.run_result_path(Path("o"), default, 8, "sae", 0) != bench.run_result_path(
        Path("o"), explicit, 8, "sae", 0
    )
    table = bench.settings_from_args(bench.parse_args(["--sft-steps-by-length", "32:900", "64:1600"]))
    assert [table.sft_steps_for(f) for f in (8, 32, 64)] == [400, 900, 1600]
    with pytest.raises(SystemExit, match="LENGTH:STEPS"):
        bench.settings_from_args(bench.parse_args(["--sft-steps-by-length", "32=800"]))


# --------------------------------------------------------------------------------------------------
# Shared helpers (benchmarks/_common.py)
# --------------------------------------------------------------------------------------------------
def test_warm_start_cache_builds_once_per_fingerprint_and_never_reuses_a_half_build(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import _common

    built: list[Path] = []

    def build(directory: Path) -> dict:
        built.append(directory)
        (directory / "model.bin").write_text("weights")
        return {"final_loss": 0.5}

    first_dir, first = _common.cached_warm_start(tmp_path, "task", {"steps": 10, "sizes": (1, 2)}, build)
    assert first["reused"] is False and first["final_loss"] == 0.5 and built == [first_dir]
    again_dir, again = _common.cached_warm_start(tmp_path, "task", {"steps": 10, "sizes": [1, 2]}, build)
    assert again_dir == first_dir and again["reused"] is True and len(built) == 1  # tuples match saved lists
    other_dir, _ = _common.cached_warm_start(tmp_path, "task", {"steps": 11, "sizes": [1, 2]}, build)
    assert other_dir != first_dir and len(built) == 2

    def crash(directory: Path) -> dict:
        raise RuntimeError("killed mid-SFT")

    with pytest.raises(RuntimeError):
        _common.cached_warm_start(tmp_path, "task", {"steps": 12}, crash)
    rebuilt_dir, rebuilt = _common.cached_warm_start(tmp_path, "task", {"steps": 12}, build)
    assert rebuilt["reused"] is False and built[-1] == rebuilt_dir


def test_tee_writes_the_log_and_restores_stdout(tmp_path, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    import _common

    before = sys.stdout
    with _common.tee_to_log(tmp_path / "run.log"):
        print("progress line")
    assert sys.stdout is before
    assert (tmp_path / "run.log").read_text() == "progress line\n"
    assert "progress line" in capsys.readouterr().out
    assert _common.finite({"a": [float("nan"), 1.0, (float("inf"),)]}) == {"a": [None, 1.0, [None]]}
    _common.save_json_atomically(tmp_path / "runs" / "r.json", {"x": float("nan")})
    assert math.isnan(json.loads((tmp_path / "runs" / "r.json").read_text())["x"])
    assert not list((tmp_path / "runs").glob("*.tmp"))
