"""benchmarks/critic_diagnosis.py: violation parsing, the explained-variance split, the ceiling, --smoke."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from trl_sae.demo.decision_task import format_walk, format_walk_prompt
from trl_sae.demo.tiny import build_char_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "critic_diagnosis.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("critic_diagnosis", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["critic_diagnosis"] = module
    spec.loader.exec_module(module)
    return module


def test_first_violation_is_the_door_equal_to_the_current_room(bench):
    tokenizer = build_char_tokenizer()
    # From c: c>e (fine), e>a (fine), a>a (violation: stays in a), a>b (fine, but the walk already failed).
    text = format_walk("c", "4821", ["e", "a", "a", "b"], filler_length=8)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    first, decisions = bench.violation_and_decisions(tokenizer, format_walk_prompt(4, "c", "4821"), ids)
    assert len(decisions) == 4
    assert first == decisions[2] == text.index("a>a") + 2
    clean = format_walk("c", "4821", ["e", "a", "b", "c"], filler_length=8)
    ids = tokenizer(clean, add_special_tokens=False)["input_ids"]
    assert bench.violation_and_decisions(tokenizer, format_walk_prompt(4, "c", "4821"), ids)[0] == -1


def _rollouts(bench, scores, first, lengths, remaining):
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return bench.Rollouts(
        prompt_ids=torch.ones(len(scores), 2, dtype=torch.long),
        prompt_mask=torch.ones(len(scores), 2, dtype=torch.long),
        completion_ids=torch.ones(len(scores), width, dtype=torch.long),
        completion_mask=mask,
        scores=torch.tensor(scores, dtype=torch.float),
        first_violation=torch.tensor(first),
        remaining=torch.tensor(remaining),
    )


def test_explained_variance_split_and_ceiling(bench):
    # Row 0 succeeds (4 tokens); row 1 violates at token 1 (tokens 2, 3 come after); row 2 (3 tokens) fails
    # without a violation (malformed). Padding (row 2, token 3) must not count.
    rollouts = _rollouts(
        bench,
        scores=[1.0, 0.0, 0.0],
        first=[-1, 1, -1],
        lengths=[4, 4, 3],
        remaining=[[2, 1, 1, 0], [2, 1, 0, 0], [2, 1, 1, 0]],
    )
    after = rollouts.after_violation()
    assert after.tolist() == [[False] * 4, [False, False, True, True], [False] * 4]
    returns = rollouts.returns()
    # A predictor exact on every token explains everything; the mean explains nothing.
    assert bench.explained_variance(returns, returns, rollouts.mask) == pytest.approx(1.0)
    mean = returns[rollouts.mask].mean()
    assert bench.explained_variance(torch.full_like(returns, mean), returns, rollouts.mask) == pytest.approx(
        0.0
    )
    # Garbage on the padding changes nothing.
    noisy = torch.where(rollouts.mask, returns, torch.full_like(returns, 7.0))
    assert bench.explained_variance(noisy, returns, rollouts.mask) == pytest.approx(1.0)
    # The ceiling: 0 after the violation, else the success rate of the tokens before a violation with as
    # many decisions ahead (fitted on the same rows here): remaining 2 -> 1 of 3 rows succeeds.
    ceiling = bench.ceiling_values(rollouts, rollouts)
    assert ceiling[1, 2:].tolist() == [0.0, 0.0]
    assert ceiling[0, 0].item() == pytest.approx(1 / 3)
    assert ceiling[0, 1].item() == pytest.approx(2 / 5)  # remaining 1 before a violation: 5 tokens, 2 succeed
    assert ceiling[2, 3].item() == 0.0  # padding
    report = bench.ev_report(ceiling, rollouts)
    assert report["mean_value_after_violation"] == 0.0
    assert 0.0 < report["ev_all"] < 1.0


def test_smoke_run_writes_results_and_plot(bench, tmp_path):
    results = bench.main(
        ["--smoke", "--output-dir", str(tmp_path), "--warm-start-dir", str(tmp_path / "warm")]
    )
    for name in ("results.json", "critic_diagnosis.png", "command.txt"):
        assert (tmp_path / name).is_file(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "--smoke" in saved["command"] == results["command"]
    settings = bench.smoke_settings()
    assert (
        saved["rollouts"]["train"] + saved["rollouts"]["test"]
        == settings.train_rollouts + settings.test_rollouts
    )
    steps = settings.train_rollouts // settings.rollout_batch
    for entry in saved["online"].values():
        assert [h["step"] for h in entry["history"]] == list(range(steps + 1))
    for entry in saved["offline"].values():
        assert [h["epoch"] for h in entry["history"]] == list(range(settings.offline_epochs + 1))
    assert math.isfinite(saved["linear_probe"]["mse_all"])
    assert [p["layer"] for p in saved["layer_probes"]] == list(range(settings.task.num_layers + 1))
    assert any("ceiling targets" in name for name in saved["offline"])
    assert any("position control" in name for name in saved["offline"])
    merged = bench.main(["--combine", str(tmp_path), "--output-dir", str(tmp_path / "combined")])
    assert (tmp_path / "combined" / "critic_diagnosis.png").is_file()
    assert set(merged["offline"]) == set(saved["offline"]) and set(merged["online"]) == set(saved["online"])


def test_trainer_explained_variance_counts_valid_tokens_only():
    """`critic/explained_variance` (trainer/parts/metrics.py) is 1 - Var(R - V) / Var(R) over the valid tokens:
    what the padding holds must not move it."""
    from accelerate import Accelerator

    from trl_sae.trainer.parts.metrics import step_metrics
    from trl_sae.trainer.rollout_batch import RolloutBatch

    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 9.0, 9.0], [0.0, 0.0, 0.0, -5.0]])
    values = torch.tensor([[0.5, 0.75, 1.0, 0.25], [0.25, 0.0, -3.0, 4.0], [0.5, 0.0, 0.25, 8.0]])
    valid = mask.bool()
    expected = 1.0 - (returns - values)[valid].var(unbiased=False) / returns[valid].var(unbiased=False)
    batch = RolloutBatch(
        prompts=["p"] * 3,
        columns={},
        prompt_ids=torch.ones(3, 2, dtype=torch.long),
        prompt_mask=torch.ones(3, 2, dtype=torch.long),
        completion_ids=torch.ones(3, 4, dtype=torch.long),
        completion_mask=mask,
        logprobs=torch.zeros(3, 4),
        entropies=torch.zeros(3, 4),
        is_truncated=torch.zeros(3, dtype=torch.bool),
        scores=torch.tensor([1.0, 0.0, 0.0]),
        values=values,
        returns=returns,
        boundaries=torch.zeros(3, 4, dtype=torch.bool),
        raw_advantages=returns - values,
    )
    metrics = step_metrics(Accelerator(cpu=True), batch, {})
    assert metrics["critic/explained_variance"] == pytest.approx(expected.item(), abs=1e-6)
    assert metrics["values/mean"] == pytest.approx(values[valid].mean().item(), abs=1e-6)
    # Without a critic (grpo) there is no fit to report, rather than a 0 that reads as a useless critic.
    without = step_metrics(Accelerator(cpu=True), batch, {}, with_critic=False)
    assert set(metrics) - set(without) == {"critic/explained_variance", "values/mean"}
    assert without["advantages/std"] == pytest.approx(metrics["advantages/std"])


def test_critic_value_at_t_reads_the_context_before_token_t():
    """docs/design.md's convention in the critic's forward: values[i, t] is the head on the last hidden state
    of prompt_i + completion_i[:t], with left-padded prompts and right-padded completions of other lengths."""
    from trl_sae.demo.tiny import build_tiny_qwen3
    from trl_sae.generation.inputs import left_pad, sequence_inputs
    from trl_sae.trainer.critics.build import build_critic_from_policy
    from trl_sae.trainer.critics.policy_and_critic import PolicyAndCritic

    tokenizer = build_char_tokenizer()
    policy = build_tiny_qwen3(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    critic = build_critic_from_policy(policy)
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.score.weight)  # the built head is zero: every value would be 0
    module = PolicyAndCritic(policy, critic).eval()
    prompts = [tokenizer("Walk 2 from c")["input_ids"], tokenizer("Walk 12 from ab")["input_ids"]]
    completions = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("1.c>e x", "2.a>a")]
    prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
    width = max(map(len, completions))
    completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    with torch.no_grad():
        inputs = sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
        values = module.critic_values(**inputs, num_completion_tokens=width)
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            for t in range(len(completion)):
                hidden = critic.model(input_ids=torch.tensor([prompt + completion[:t]])).last_hidden_state
                assert values[i, t].item() == pytest.approx(critic.score(hidden[:, -1]).item(), abs=1e-5)
