"""benchmarks/refactor_fingerprint.py: the same code gives the same fingerprints, and a change to what a step
computes changes them (else diffing them before and after a refactor would prove nothing)."""

from __future__ import annotations

import pytest

from .test_bench_memory import load_benchmark


@pytest.fixture(scope="module")
def bench():
    yield from load_benchmark("refactor_fingerprint")


def test_a_run_fingerprints_the_same_twice_and_differently_when_a_step_changes(bench, tmp_path, monkeypatch):
    from trl_sae.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    first = bench.run_case("grpo", tokenizer, str(tmp_path / "a"))
    assert first == bench.run_case("grpo", tokenizer, str(tmp_path / "b"))
    monkeypatch.setitem(bench.CASES, "grpo", ({"advantage_estimator": "grpo", "learning_rate": 1e-3}, {}))
    assert bench.run_case("grpo", tokenizer, str(tmp_path / "c")) != first


def test_an_unknown_set_up_is_refused_naming_the_choices(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["nope"])
    assert "unknown set-up 'nope'; choose from separate-sae, " in capsys.readouterr().err
