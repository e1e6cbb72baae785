"""benchmarks/sample_efficiency.py: the --smoke form runs end to end and writes every output file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sample_efficiency.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("sample_efficiency_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules, so register before executing.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_steps_to_threshold_is_the_first_evaluation_at_or_above_it(bench):
    assert bench.steps_to_threshold([0, 5, 10, 15], [0.2, 0.4, 0.6, 0.5], 0.55) == 10
    assert bench.steps_to_threshold([0, 5, 10], [0.2, 0.4, 0.5], 0.55) is None
    assert bench.steps_to_threshold([0, 5], [0.6, 0.7], 0.6) == 0


def test_curve_summary_gives_final_values_and_steps_to_threshold_over_seeds(bench):
    curves = [([0, 5, 10], [0.2, 0.6, 0.8]), ([0, 5, 10], [0.1, 0.3, 0.5])]
    row = bench.common.curve_summary(curves, 0.55, "accuracy")
    assert row["final_accuracy_per_seed"] == [0.8, 0.5]
    assert row["final_accuracy_mean"] == pytest.approx(0.65)
    assert row["final_accuracy_std"] == pytest.approx(0.15 * 2**0.5)  # ddof=1 over two seeds
    assert row["steps_to_threshold_per_seed"] == [5, None]
    assert (row["steps_to_threshold_mean"], row["seeds_reaching_threshold"]) == (5.0, 1)
    assert bench.common.curve_summary(curves[1:], 0.9, "x")["steps_to_threshold_mean"] is None


def test_estimators_differ_only_in_the_estimator(bench):
    settings = bench.Settings()
    for name in bench.ESTIMATORS:
        overrides = bench.estimator_overrides(name, settings)
        assert overrides["advantage_estimator"] == name
        # GRPO alone skips the value warm-up: it has no critic.
        assert set(overrides) - {"advantage_estimator"} == (
            {"value_warmup_steps"} if name == "grpo" else set()
        )
    with pytest.raises(ValueError, match="Unknown estimator"):
        bench.estimator_overrides("ppo", settings)


def test_smoke_run_writes_table_json_and_figures(bench, tmp_path):
    results = bench.main(["--smoke", "--output-dir", str(tmp_path)])

    for name in ("results.json", "results.md", "command.txt", "learning_curves.png"):
        assert (tmp_path / name).is_file(), name
    for name in ("learning_curves.png", "advantage_correlation.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG"), name
        assert len(data) < 300_000, f"{name} is {len(data)} bytes"

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["command"] == results["command"]
    assert "--smoke" in saved["command"]
    assert saved["environment"]["torch_num_threads"] == 1
    assert saved["settings"]["seeds"] == [0] and saved["settings"]["steps"] == 2
    assert [row["estimator"] for row in saved["summary"]] == list(bench.ESTIMATORS)
    assert len(saved["runs"]) == len(bench.ESTIMATORS)
    for run in saved["runs"]:
        assert run["eval_steps"] == [0, 1, 2]
        assert all(0.0 <= acc <= 1.0 for acc in run["eval_accuracy"])
        assert len(run["train"]["reward/mean"]) == 2
    for row in saved["summary"]:
        assert 0.0 <= row["final_accuracy_mean"] <= 1.0
    assert saved["correlation"]["rows"], "the advantage-correlation analysis did not run"
    assert (tmp_path / "advantage_correlation.json").is_file()

    markdown = (tmp_path / "results.md").read_text()
    assert "| estimator | final held-out acc" in markdown
    assert "| sae |" in markdown and "| grpo |" in markdown
    assert saved["command"] in markdown

    # Every finished run is kept under runs/ by the one runner: a rerun reuses them (nothing trains) and reports
    # the same numbers; with the correlation, the first seed's SAE run is rerun for its live critic.
    assert len(list((tmp_path / "runs").glob("*.json"))) == len(bench.ESTIMATORS)
    again = bench.main(["--smoke", "--no-correlation", "--output-dir", str(tmp_path)])
    log = (tmp_path / "run.log").read_text()
    assert log.count(": reused ") == len(bench.ESTIMATORS) and ": done in" not in log
    assert json.loads(json.dumps(again["runs"])) == json.loads(json.dumps(results["runs"]))
    assert "## Command" in (tmp_path / "results.md").read_text()
    settings = bench.smoke_settings()
    assert bench.run_result_path(tmp_path, settings, "sae", 0).is_file()
    changed = bench.replace(settings, learning_rate=1e-3)  # a changed PPO setting is another run
    assert not bench.run_result_path(tmp_path, changed, "sae", 0).exists()
