"""benchmarks/known_error_critic.py: the walk task's oracle critic plus noise, and its --smoke run."""

from __future__ import annotations

import importlib.util
import json
import sys
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


# --------------------------------------------------------------------------------------------------
# Critic errors of the right kind (issue 30)
# --------------------------------------------------------------------------------------------------
def _positions(bench, tokenizer, texts, k=3, f=2):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    problems = [_problem("c", "12", k, f)] * len(texts)
    scans, starts = bench.scan_completions(tokenizer, ids, problems)
    width = max(len(i) for i in ids) + 2
    return ids, problems, bench.walk_positions(scans, starts, problems, width), width


def test_failure_blind_mixes_the_true_and_the_position_only_value(bench, tokenizer):
    """blind with mix 1 is exactly rate ** k_t everywhere (it never sees the failure), mix 0.5 is the midpoint;
    before the failure every critic but iid's noise equals V*."""
    good = format_walk("c", "12", ["e", "a", "b"], 2)
    bad = format_walk("c", "12", ["e", "e", "b"], 2)
    _, _, (ahead, failed, valid), _ = _positions(bench, tokenizer, [good, bad])
    rate = 0.8
    exact = bench.walk_values(ahead, failed, valid, rate)
    blind = bench.walk_values(ahead, failed, valid, rate, bench.CriticError("blind", mix=1.0))
    half = bench.walk_values(ahead, failed, valid, rate, bench.CriticError.parse("blind0.5"))
    position_only = torch.where(valid, torch.tensor(rate, dtype=torch.float64) ** ahead, 0.0).float()
    torch.testing.assert_close(blind, position_only)
    torch.testing.assert_close(half, (exact + position_only) / 2)
    assert exact[1, 25:].abs().max() == 0 and blind[1, 25 : valid[1].sum()].min() > 0  # after the failure
    torch.testing.assert_close(blind[0], exact[0])  # a walk that never fails: no difference


def test_stale_critic_is_the_oracle_of_the_earlier_rate(bench, tokenizer):
    good = format_walk("c", "12", ["e", "a", "b"], 2)
    bad = format_walk("c", "12", ["e", "e", "b"], 2)
    _, _, (ahead, failed, valid), _ = _positions(bench, tokenizer, [good, bad])
    stale = bench.walk_values(ahead, failed, valid, 0.95, bench.CriticError("stale"), old_rate=0.6)
    torch.testing.assert_close(stale, bench.walk_values(ahead, failed, valid, 0.6))
    constant = bench.walk_values(ahead, failed, valid, 0.95, bench.CriticError("constant"), mean_outcome=0.3)
    assert (
        constant[valid].tolist() == pytest.approx([0.3] * int(valid.sum()))
        and constant[~valid].abs().max() == 0
    )
    with pytest.raises(ValueError, match="old_rate"):
        bench.walk_values(ahead, failed, valid, 0.95, bench.CriticError("stale"))
    with pytest.raises(ValueError, match="learned"):
        bench.walk_values(ahead, failed, valid, 0.95, bench.CriticError("learned"))


def test_critic_error_names_round_trip_and_bad_arms_are_refused(bench):
    for name in ("exact", "iid0.25", "blind0.5", "blind1", "stale", "constant", "learned"):
        assert bench.CriticError.parse(name).name == name
    for bad, match in (("iid", "number"), ("blind", "number"), ("lagging", "kind"), ("blind1.5", "mix")):
        with pytest.raises(ValueError, match=match):
            bench.CriticError.parse(bad)
    with pytest.raises(ValueError, match="sigma"):
        bench.CriticError("exact", sigma=0.1)


def test_a_walk_ending_at_its_first_violation_has_a_learnable_value(bench, tokenizer):
    """Cut after the failing character (the second door stays in room e): reward 0, the rest is padding, and the
    oracle's value before every kept token is rate ** k_t: no token after the failure is left to be 0."""
    from trl_sae.trainer.rollout_batch import RolloutBatch

    good = format_walk("c", "12", ["e", "a", "b"], 2)
    bad = format_walk("c", "12", ["e", "e", "b"], 2)
    ids, problems, _, width = _positions(bench, tokenizer, [good, bad])
    completion_ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, row_ids in enumerate(ids):
        completion_ids[row, : len(row_ids)] = torch.tensor(row_ids)
        mask[row, : len(row_ids)] = 1
    batch = RolloutBatch(
        prompts=["p", "p"],
        columns={key: [p[key] for p in problems] for key in problems[0]},
        prompt_ids=torch.ones(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=mask,
        logprobs=torch.full((2, width), -0.5),
        entropies=torch.ones(2, width),
        is_truncated=torch.tensor([False, True]),
    )
    lengths = bench.end_walks_at_violation(batch, tokenizer)
    assert lengths.tolist() == [len(ids[0]), 25]  # the failing door is token 24
    assert mask[1, :25].all() and not mask[1, 25:].any()
    assert (completion_ids[1, 25:] == tokenizer.pad_token_id).all() and batch.logprobs[
        1, 25:
    ].abs().max() == 0
    assert not batch.is_truncated[1]
    text = tokenizer.decode(completion_ids[1, :25].tolist(), skip_special_tokens=True)
    assert text == bad[:25] and _reward(text, "c", "12", 3, 2) == 0.0
    values, rate = bench.oracle_values(tokenizer, [ids[0], ids[1][:25]], problems, width)
    assert values[1, :25].min().item() > 0  # every kept state still has a chance
    expected = [rate**3 if t <= 7 else rate**2 for t in range(25)]
    torch.testing.assert_close(values[1, :25], torch.tensor(expected).float())


def test_advantages_scaled_to_unit_std_keep_zeros_and_signs(bench):
    advantages = torch.tensor([[0.0, 0.2, -0.4, 9.0], [0.0, 0.0, 0.6, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    scaled = bench.scale_to_unit_std(advantages, mask)
    assert scaled[mask].std(unbiased=False).item() == pytest.approx(1.0)
    assert scaled[~mask].abs().max() == 0 and (scaled[mask] == 0).tolist() == (advantages[mask] == 0).tolist()
    assert (torch.sign(scaled[mask]) == torch.sign(advantages[mask])).all()


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
    return bench.WalkPPOTrainer(
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


def test_trainer_stale_critic_keeps_the_first_batch_rate_and_learned_runs_the_critic(
    bench, tokenizer, tiny_model, tmp_path
):
    trainer = _trainer(bench, tokenizer, tiny_model, tmp_path, critic="stale")
    seen = []
    original = trainer._compute_advantages
    trainer._compute_advantages = lambda batch: (seen.append(batch), original(batch))
    trainer.train_step(0)
    trainer.train_step(1)
    first, second = trainer.oracle_rates
    assert trainer.old_rate == first
    ids, problems = bench.batch_problems(seen[1])
    # The second step's values are the exact oracle of the FIRST step's rate, whatever the second's is.
    scans, starts = bench.scan_completions(tokenizer, ids, problems)
    ahead, failed, valid = bench.walk_positions(scans, starts, problems, seen[1].completion_ids.shape[1])
    torch.testing.assert_close(seen[1].values, bench.walk_values(ahead, failed, valid, first))
    assert bench.per_decision_success_rate(scans) == pytest.approx(second)

    learned = _trainer(bench, tokenizer, tiny_model, tmp_path / "l", critic="learned", end_at_violation=True)
    unwrapped = learned.accelerator.unwrap_model(learned.model)
    calls = []
    hook = unwrapped.critic.score.register_forward_hook(lambda *args: calls.append(1))
    batches = []
    original = learned._compute_advantages
    learned._compute_advantages = lambda batch: (batches.append(batch), original(batch))
    learned.train_step(0)
    hook.remove()
    assert calls  # the learned critic is run (values and value loss)
    ids, problems = bench.batch_problems(batches[0])
    scans, _ = bench.scan_completions(tokenizer, ids, problems)
    for scan, row_ids in zip(scans, ids):  # every walk ends at its failure, if any
        assert scan.fail is None or scan.fail == len(row_ids) - 1


def test_trainer_std_scale_needs_unwhitened_advantages(bench, tokenizer, tiny_model, tmp_path):
    with pytest.raises(ValueError, match="whiten_advantages=False"):
        _trainer(bench, tokenizer, tiny_model, tmp_path, advantage_scale="std")
    with pytest.raises(ValueError, match="advantage_scale"):
        _trainer(bench, tokenizer, tiny_model, tmp_path, advantage_scale="unit")
    with pytest.raises(ValueError, match="not both"):
        _trainer(bench, tokenizer, tiny_model, tmp_path, critic="exact", sigma=0.1)


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------
def test_smoke_run_writes_every_output_and_a_rerun_skips_finished_runs(bench, tmp_path):
    args = ["--smoke", "--output-dir", str(tmp_path), "--warm-start-dir", str(tmp_path / "warm")]
    results = bench.main(args)
    for name in (
        "results.json",
        "results.md",
        "command.txt",
        "run.log",
        "final_success.png",
        "learning_curves.png",
    ):
        assert (tmp_path / name).is_file(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [(r["critic"], r["estimator"]) for r in saved["summary"]] == [
        (c, e) for c in ("exact", "iid0.5", "learned") for e in ("sae", "gae")
    ]
    assert len(list((tmp_path / "runs").glob("*.json"))) == len(saved["runs"]) == 6
    for run in saved["runs"]:
        # Actor steps only: the learned arm's warm-up step is not among its evaluation points or its rates.
        # The warm start, then every actor step (the smoke evaluates every step).
        assert run["eval_steps"] == [0, 1, 2]
        assert len(run["oracle_rates"]) == 2 and all(0.0 <= r <= 1.0 for r in run["oracle_rates"])
        if run["critic"] == "learned":
            assert run["warmup_check"]["walks"] == 4 * 2 and 0.0 <= run["warmup_check"]["success"] <= 1.0
        else:
            assert run["warmup_check"] is None
    # The iid noise goes into every TD residual: larger raw advantages than the exact critic's, run for run.
    raw = {(r["critic"], r["estimator"]): r["train"]["advantages/std"] for r in saved["runs"]}
    for estimator in ("sae", "gae"):
        assert min(raw[("iid0.5", estimator)]) > max(raw[("exact", estimator)])
    primary = [t for t in saved["tests"] if t["family"] == "primary"]
    assert [(t["critic"], t["versus"], t["outcome"]) for t in primary] == [
        ("learned", "gae", "final_success")
    ]
    assert {t["critic"] for t in saved["tests"]} == {"exact", "iid0.5", "learned"}
    text = (tmp_path / "results.md").read_text()
    assert "Pre-registered tests" in text and "| learned | sae |" in text
    # A rerun reuses every finished run (nothing trains) and reports the same numbers.
    again = bench.main(args)
    log = (tmp_path / "run.log").read_text()
    assert log.count(": reused ") == 6 and ": done in" not in log
    assert json.loads(json.dumps(again["runs"])) == json.loads(json.dumps(results["runs"]))


def test_runner_skips_finished_jobs_reruns_forced_ones_and_commits_each(tmp_path):
    import subprocess

    sys.path.insert(0, str(SCRIPT.parent))
    import _common as common

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for key, value in (("user.email", "t@example.com"), ("user.name", "t")):
        subprocess.run(["git", "-C", str(tmp_path), "config", key, value], check=True)
    ran = []

    def job(name, force=False):
        return common.Job(
            name, tmp_path / "runs" / f"{name}.json", lambda: ran.append(name) or {"name": name}, force
        )

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.json").write_text(json.dumps({"name": "a, from before"}))
    (tmp_path / "runs" / "c.json").write_text(json.dumps({"name": "c, from before"}))
    (tmp_path / "unrelated.txt").write_text("staged but not part of any run")
    subprocess.run(["git", "-C", str(tmp_path), "add", "unrelated.txt"], check=True)
    payloads = common.run_jobs([job("a"), job("b"), job("c", force=True)], commit=True)
    assert ran == ["b", "c"]
    assert [p["name"] for p in payloads] == ["a, from before", "b", "c"]
    log = subprocess.run(
        ["git", "-C", str(tmp_path), "log", "--name-only", "--format=%s"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert [line for line in log if line.startswith("runs/")] == [
        "runs/c.json",
        "runs/b.json",
    ]  # one commit each
    status = subprocess.run(
        ["git", "-C", str(tmp_path), "status", "--short"], capture_output=True, text=True
    ).stdout
    assert "A  unrelated.txt" in status  # what else was staged stays staged, uncommitted
    assert not list((tmp_path / "runs").glob("*.tmp"))


def test_commit_waits_for_another_sweep_process_index_lock(tmp_path, monkeypatch):
    """Two sweep processes share one checkout: a commit finding the other's index.lock retries, not crashes."""
    import subprocess
    import threading

    sys.path.insert(0, str(SCRIPT.parent))
    import _common as common

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for key, value in (("user.email", "t@example.com"), ("user.name", "t")):
        subprocess.run(["git", "-C", str(tmp_path), "config", key, value], check=True)
    result = tmp_path / "run.json"
    result.write_text("{}")
    lock = tmp_path / ".git" / "index.lock"
    lock.write_text("")
    threading.Timer(1.5, lock.unlink).start()  # the other process finishes its commit
    monkeypatch.chdir(tmp_path.parent)  # the sweeps pass --output-dir relative to where they were started
    common.git_commit_file(Path(tmp_path.name) / "run.json", "run finished")
    log = subprocess.run(["git", "-C", str(tmp_path), "log", "--format=%s"], capture_output=True, text=True)
    assert log.stdout.split("\n")[0] == "run finished"

    other = tmp_path / "other.json"
    other.write_text("{}")
    lock.write_text("")  # a lock nobody releases: the error names git's message after the attempts
    with pytest.raises(RuntimeError, match=r"index\.lock"):
        common.git_commit_file(other, "never", attempts=2)


# The pilots' runs and the sweep's own, as committed so far (the sweep adds files as it runs: at least the 14
# pilot runs that existed when this test was written).
PILOT_RUNS = sorted((SCRIPT.parent / "results" / "known_error_critic").glob("issue30*/runs/*.json"))


def test_committed_pilot_runs_are_recognised_as_finished(bench):
    """Every committed issue-30 run (pilots and sweep) is found where the runner looks for it and reused, not rerun.

    The issue-30 sweep resumes from such files: a changed fingerprint, file name or payload key would silently
    rerun (or misread) all of them. Each run's settings are its own saved ones (the pilots ran under the NLL
    weight of their day), so the path is rebuilt from exactly what produced it.
    """
    assert len(PILOT_RUNS) >= 14
    jobs = []
    for path in PILOT_RUNS:
        payload = json.loads(path.read_text())
        assert list(payload) == ["settings", "critic", "result", "oracle_rates", "warmup_check"]
        settings = bench.Settings(**payload["settings"])
        result = payload["result"]
        found = bench.run_path(
            path.parents[1], settings, payload["critic"], result["estimator"], result["seed"]
        )
        assert found == path
        jobs.append(bench.common.Job(path.stem, found, lambda: pytest.fail("a finished pilot run was rerun")))
    assert bench.common.run_jobs(jobs) == [json.loads(p.read_text()) for p in PILOT_RUNS]


def test_the_issue30_sweep_keeps_its_run_names(bench):
    """The pre-registered sweep's run files, as the code that started it names them (pinned: it resumes by name)."""
    assert bench.run_path(Path("o"), bench.default_settings(), "blind0.5", "sae", 3) == Path(
        "o/runs/blind0.5-sae-seed3-1536ffe26abe.json"
    )
