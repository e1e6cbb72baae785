"""benchmarks/known_error_critic.py: the walk task's oracle critic plus noise, and its --smoke run."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.demo.decision_task import decision_char_positions, format_walk, make_walk_dataset, walk_reward

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "known_error_critic.py"
DOORS = "abcdefg"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("known_error_critic_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _reward(text: str, start: str, tag: str, k: int, f: int) -> float:
    return walk_reward(
        completions=[text], start=[start], tag=[tag], doors=[DOORS], num_decisions=[k], filler_length=[f]
    )[0]


def _problem(start: str, tag: str, k: int, f: int) -> dict:
    return {"start": start, "tag": tag, "doors": DOORS, "num_decisions": k, "filler_length": f}


# --------------------------------------------------------------------------------------------------
# Where a walk fails
# --------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    start=st.sampled_from(DOORS),
    path=st.lists(st.sampled_from(DOORS + "z"), min_size=1, max_size=4),
    filler_length=st.integers(0, 6),
    corrupt=st.one_of(st.none(), st.tuples(st.integers(0, 10_000), st.sampled_from("ab1.:>x \n"))),
)
def test_scan_walk_fails_at_the_first_forbidden_door_or_wrong_character(
    bench, start, path, filler_length, corrupt
):
    """Independent of the scanner: in a formatted walk the first failure is its first forbidden door (or a door
    outside the set), or an earlier corrupted non-door character (each has exactly one correct value); the
    failure is decided by the prefix alone; a walk without failure scores 1, one with a failure 0."""
    tag, k = "4821", len(path)
    text = format_walk(start, tag, path, filler_length)
    doors = decision_char_positions(text)
    expected, room = None, start
    for door, offset in zip(path, doors):
        if door == room or door not in DOORS:
            expected = offset
            break
        room = door
    if corrupt is not None:
        position = corrupt[0] % len(text)
        if position not in doors and text[position] != corrupt[1]:
            text = text[:position] + corrupt[1] + text[position + 1 :]
            expected = position if expected is None else min(expected, position)
    scan = bench.scan_walk(text, start, tag, DOORS, k, filler_length)
    assert scan.fail == expected
    assert _reward(text, start, tag, k, filler_length) == (1.0 if expected is None else 0.0)
    assert scan.violations == int(expected is not None and expected in doors)
    assert list(scan.decisions) == [d for d in doors if expected is None or d <= expected]
    # The prefix decides: every prefix fails where the whole text fails, or not at all if that lies beyond it.
    for cut in range(0, len(text) + 1, 3):
        assert bench.scan_walk(text[:cut], start, tag, DOORS, k, filler_length).fail == (
            expected if expected is not None and expected < cut else None
        )


def test_scan_walk_on_hand_made_walks(bench):
    good = format_walk("c", "12", ["e", "a"], 3)  # "1.12:c>e wal at e\n2.12:e>a wal at a\nEND a"
    assert bench.scan_walk(good, "c", "12", DOORS, 2, 3) == bench.WalkScan(None, (7, 25), 0)
    assert bench.scan_walk(good + "  \n", "c", "12", DOORS, 2, 3).fail is None  # the reward strips whitespace
    assert bench.scan_walk(good + "x", "c", "12", DOORS, 2, 3).fail == len(good)
    stays = format_walk("c", "12", ["e", "e"], 3)
    assert bench.scan_walk(stays, "c", "12", DOORS, 2, 3) == bench.WalkScan(25, (7, 25), 1)
    outside = format_walk("c", "12", ["z"], 3)
    assert bench.scan_walk(outside, "c", "12", DOORS, 1, 3) == bench.WalkScan(7, (7,), 1)
    assert bench.scan_walk("1.13:c>e", "c", "12", DOORS, 2, 3) == bench.WalkScan(3, (), 0)
    assert bench.scan_walk("1.12:c>", "c", "12", DOORS, 2, 3) == bench.WalkScan(None, (), 0)
    assert bench.per_decision_success_rate(
        [bench.WalkScan(None, (7, 25), 0), bench.WalkScan(25, (7, 25), 1), bench.WalkScan(3, (), 0)]
    ) == pytest.approx(0.75)
    assert bench.per_decision_success_rate([]) == 1.0


# --------------------------------------------------------------------------------------------------
# The oracle's values
# --------------------------------------------------------------------------------------------------
def test_oracle_values_follow_the_index_convention(bench, tokenizer):
    """values[t] is the state before token t: rate ** decisions at t or later, 0 after the failing token."""
    good = format_walk("c", "12", ["e", "a", "b"], 2)
    bad = format_walk("c", "12", ["e", "e", "b"], 2)
    ids = [
        tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for text in (good, bad)
    ]
    problems = [_problem("c", "12", 3, 2)] * 2
    width = max(len(i) for i in ids) + 3
    values, rate = bench.oracle_values(tokenizer, ids, problems, width)
    # 5 decision doors reached with a correct prefix (3 + the bad walk's 2), one of them forbidden.
    assert rate == pytest.approx(4 / 5)
    doors = [7, 24, 41]  # character (= token) offsets of the doors: "1.12:c>e wa at e\n" is 17 characters
    assert [good[d] for d in doors] == ["e", "a", "b"]
    expected_good = torch.tensor(
        [
            rate**3 if t <= doors[0] else rate**2 if t <= doors[1] else rate if t <= doors[2] else 1.0
            for t in range(len(ids[0]))
        ]
    )
    torch.testing.assert_close(values[0, : len(ids[0])], expected_good.float())
    # The second door (offset 24) stays in room e: values up to and including it know nothing yet, then 0.
    assert values[1, 24].item() == pytest.approx(rate**2)
    assert values[1, 25:].abs().max().item() == 0.0
    assert values[0, len(ids[0]) :].abs().max().item() == 0.0  # padding


def test_oracle_noise_is_zero_mean_unclipped_seeded_and_only_on_valid_tokens(bench, tokenizer):
    text = format_walk("c", "12", ["e", "a", "b"], 2)
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"]] * 40
    width = len(ids[0]) + 5
    problems = [_problem("c", "12", 3, 2)] * 40
    clean, _ = bench.oracle_values(tokenizer, ids, problems, width)
    noisy, _ = bench.oracle_values(tokenizer, ids, problems, width, 0.5, torch.Generator().manual_seed(3))
    again, _ = bench.oracle_values(tokenizer, ids, problems, width, 0.5, torch.Generator().manual_seed(3))
    torch.testing.assert_close(noisy, again)
    noise = (noisy - clean)[:, : len(ids[0])]
    assert abs(noise.mean().item()) < 0.02  # 1,560 draws: the mean's std is 0.5 / 39.5 = 0.013
    assert noise.std().item() == pytest.approx(0.5, rel=0.05)
    assert noisy.min().item() < -0.5 and noisy.max().item() > 1.5  # not clipped to [0, 1]
    assert noisy[:, len(ids[0]) :].abs().max().item() == 0.0
    with pytest.raises(ValueError, match="generator"):
        bench.oracle_values(tokenizer, ids, problems, width, 0.5)


def test_oracle_value_fn_reads_the_problem_from_the_prompt(bench, tokenizer):
    from trl_sae.demo.warmstart import encode_prompt
    from trl_sae.generation.inputs import left_pad, right_pad

    rows = make_walk_dataset(2, num_decisions=3, filler_length=2, seed=5)
    completions = [
        format_walk(r["start"], r["tag"], ["a" if r["start"] != "a" else "b"] * 1 + ["c", "d"], 2)
        for r in rows
    ]
    prompt_ids, prompt_mask = left_pad(
        [encode_prompt(tokenizer, r["prompt"]) for r in rows], tokenizer.pad_token_id
    )
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    completion_ids = right_pad(ids, tokenizer.pad_token_id, torch.long)
    mask = (completion_ids != tokenizer.pad_token_id).long()
    value_fn = bench.oracle_value_fn(tokenizer, DOORS, 2, sigma=0.0, noise_seed=0)
    values = value_fn(
        torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1), prompt_ids.shape[1]
    )
    direct, _ = bench.oracle_values(
        tokenizer, ids, [_problem(r["start"], r["tag"], 3, 2) for r in rows], completion_ids.shape[1]
    )
    torch.testing.assert_close(values, direct)
    assert values.abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------
def _trainer(bench, tokenizer, model, tmp_path, **kwargs):
    from trl_sae import SAEPPOConfig

    data = make_walk_dataset(8, num_decisions=2, filler_length=1, seed=0, teacher_error_rate=0.3)
    data = data.remove_columns(["solution", "solution_is_correct"])
    config = SAEPPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        response_length=40,
        learning_rate=1e-3,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        advantage_estimator=kwargs.pop("advantage_estimator", "sae"),
        seed=0,
    )
    return bench.OracleCriticPPOTrainer(
        model=model,
        reward_funcs=walk_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        **kwargs,
    )


def test_trainer_uses_the_oracle_and_never_runs_or_trains_the_critic(bench, tokenizer, tiny_model, tmp_path):
    trainer = _trainer(bench, tokenizer, tiny_model, tmp_path, sigma=0.25, noise_seed=7)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    critic_before = [p.detach().clone() for p in unwrapped.critic_parameters()]
    actor_before = [p.detach().clone() for p in unwrapped.actor_parameters()]
    seen = {}
    original = trainer._compute_advantages

    def spy(batch):
        seen["batch"] = batch
        original(batch)

    trainer._compute_advantages = spy
    critic_calls = []
    hook = unwrapped.critic.score.register_forward_hook(lambda *args: critic_calls.append(1))
    trainer.train_step(0)
    hook.remove()
    assert critic_calls == []  # no critic forward: neither for the values nor in the update
    batch = seen["batch"]
    ids = [batch.completion_ids[i, : int(n)].tolist() for i, n in enumerate(batch.lengths.tolist())]
    problems = [
        {k: batch.columns[k][i] for k in ("start", "tag", "doors", "num_decisions", "filler_length")}
        for i in range(len(ids))
    ]
    expected, rate = bench.oracle_values(
        tokenizer,
        ids,
        problems,
        batch.completion_ids.shape[1],
        0.25,
        torch.Generator().manual_seed(7 * 100003),
    )
    torch.testing.assert_close(batch.values, expected)
    assert trainer.oracle_rates == [pytest.approx(rate)]
    for before, after in zip(critic_before, unwrapped.critic_parameters()):
        assert torch.equal(before, after)  # no value loss: the critic is never trained
    assert any(not torch.equal(b, a) for b, a in zip(actor_before, unwrapped.actor_parameters()))


def test_trainer_rejects_a_negative_sigma_and_critic_free_estimators(bench, tokenizer, tiny_model, tmp_path):
    with pytest.raises(ValueError, match="sigma"):
        _trainer(bench, tokenizer, tiny_model, tmp_path, sigma=-0.1)
    with pytest.raises(ValueError, match="reads no critic"):
        _trainer(bench, tokenizer, tiny_model, tmp_path, advantage_estimator="grpo")


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------
def test_smoke_run_writes_every_output(bench, tmp_path):
    start = time.perf_counter()
    results = bench.main(
        ["--smoke", "--output-dir", str(tmp_path), "--warm-start-dir", str(tmp_path / "warm")]
    )
    assert time.perf_counter() - start < 60
    for name in (
        "results.json",
        "results.md",
        "command.txt",
        "run.log",
        "success_vs_sigma.png",
        "paired_sae_minus_gae.png",
        "learning_curves.png",
        "correlation_vs_sigma.png",
    ):
        assert (tmp_path / name).is_file(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [s["sigma"] for s in saved["summaries"]] == [0.0, 0.5]
    assert len(saved["runs"]) == 2 * 2
    assert set(saved["correlation"]) == {"0", "0.5"}
    for c in saved["correlation"].values():
        assert set(c["rows"]) == {"gae", "mc", "sae", "adaptive_lambda"}
    for summary in saved["summaries"]:
        assert {p["versus"] for p in summary["paired"]} == {"gae"}
    for rates in saved["oracle_rates"].values():
        assert len(rates) == 2 and all(0.0 <= r <= 1.0 for r in rates)
    # Every run keeps its advantages' per-step scale (unwhitened runs differ in it); the summary reports it.
    # The noise goes into every TD residual, so sigma 0.5 must give each run a larger spread than sigma 0.
    spread = {
        (sigma, run["estimator"], run["seed"]): run["train"]["advantages/std"]
        for sigma, run in zip(saved["run_sigmas"], saved["runs"])
    }
    for (sigma, estimator, seed), stds in spread.items():
        assert len(stds) == 2 and all(math.isfinite(v) and v >= 0 for v in stds)
        if sigma == 0.5:
            assert min(stds) > max(spread[(0.0, estimator, seed)])
    for summary in saved["summaries"]:
        for row in summary["rows"]:
            mine = [
                v
                for (sigma, e, _), v in spread.items()
                if sigma == summary["sigma"] and e == row["estimator"]
            ]
            assert row["advantage_std"] == pytest.approx(sum(sum(v) / len(v) for v in mine) / len(mine))
    assert "advantage std" in (tmp_path / "results.md").read_text()
    # An interrupted sweep resumes: finished runs are reused.
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
    assert (tmp_path / "run.log").read_text().count("reused") == 4
    assert json.loads(json.dumps(again["runs"])) == json.loads(json.dumps(results["runs"]))
    assert not math.isnan(results["warm_success"])
