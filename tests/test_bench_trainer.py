"""benchmarks/bench_trainer.py's step-time table runs on every supported TRL: the stock TRL PPO row only where
the installed TRL still has ``trl.experimental.ppo`` (1.12; 1.13 deleted it)."""

from __future__ import annotations

import pytest

from .test_bench_memory import load_benchmark


@pytest.fixture(scope="module")
def bench():
    yield from load_benchmark("bench_trainer")


def test_the_stock_trl_check_follows_the_installed_trl(bench):
    try:
        import trl.experimental.ppo  # noqa: F401

        expected = True
    except ImportError:
        expected = False
    assert bench.stock_trl_ppo_available() is expected


@pytest.mark.parametrize("stock", [True, False])
def test_the_step_time_table_has_a_stock_trl_row_only_where_trl_has_one(bench, monkeypatch, capsys, stock):
    # Before: the table always timed TRL's stock PPOTrainer, so on TRL 1.13+ the whole benchmark failed on
    # `from trl.experimental.ppo import ...`.
    monkeypatch.setattr(bench, "_timing_setup", lambda seq_len, batch_size: (None, None, None))
    monkeypatch.setattr(bench, "stock_trl_ppo_available", lambda: stock)
    monkeypatch.setattr(bench, "_time_stock_trl", lambda *args: (4.0, None))
    # gae 2 s, sae 3 s, grpo 1 s, a critic arm 1.5 s a step; the update takes half of it
    seconds = {"gae": 2.0, "sae": 3.0, "grpo": 1.0}

    def sae_trainer(estimator, *args, **kwargs):
        step = seconds[estimator] if len(args) < 8 or estimator == "grpo" else 1.5
        return step, step / 2

    monkeypatch.setattr(bench, "_time_sae_trainer", sae_trainer)
    result = bench.step_time_comparison(steps=1, seq_len=4, batch_size=2, repeats=1)
    assert (bench.STOCK_TRL in result["best"]) is stock
    bench.print_step_time_table(result)
    table = capsys.readouterr().out
    if stock:
        assert "| TRL PPOTrainer (stock GAE) | 4.000 | 1.00x |" in table
        assert "| SAEPPOTrainer (sae) | 3.000 | 0.75x | 1.500x |" in table
    else:
        assert "TRL PPOTrainer (stock GAE) |" not in table
        assert "| SAEPPOTrainer (sae) | 3.000 | - | 1.500x |" in table
        assert "no stock TRL row" in table
    assert "| kl 0: sae, head critic | 1.500 |" in table and "| 1.50x | 0.750 | 1.50x |" in table
