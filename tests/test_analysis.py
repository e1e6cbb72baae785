"""Tests of trl_sae.analysis: bootstrap Pearson, span picking, Monte-Carlo A*, the end-to-end correlation
table on the tiny Qwen3, segment statistics and plots."""

from __future__ import annotations

import json
import math
import sys
from itertools import pairwise

import numpy as np
import pytest
import torch

from trl_sae.analysis import (
    CorrelationResult,
    CorrelationRow,
    SegmentStatsRow,
    SpanRecord,
    correlate_advantages,
    critic_value_fn,
    monte_carlo_values,
    pearson_with_bootstrap,
    pick_spans,
    plot_correlations,
    plot_segment_stats,
    segment_anchors,
    segment_stats_from_logprobs,
    segment_stats_vs_threshold,
)
from trl_sae.generation.inputs import encode_prompt as _encode_prompt


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny model is all thread-synchronisation overhead on a shared 2-core machine: one thread runs
    # its generation ~100x faster. Restored so other test modules see the usual setting.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _correlated_groups(num_groups: int, rho: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of 1-6 identical points, each group's (x, y) bivariate normal with correlation ``rho``.

    Group sizes are independent of the values, so the population correlation of the points is ``rho``.
    """
    rng = np.random.default_rng(seed)
    cov = np.array([[1.0, rho], [rho, 1.0]])
    xy = rng.multivariate_normal([3.0, -1.0], cov, size=num_groups)
    sizes = rng.integers(1, 7, size=num_groups)
    groups = np.repeat(np.arange(num_groups), sizes)
    return xy[groups, 0], xy[groups, 1], groups


# --------------------------------------------------------------------------------------------------
# pearson_with_bootstrap
# --------------------------------------------------------------------------------------------------
def test_pearson_point_estimate_matches_numpy():
    x, y, groups = _correlated_groups(300, 0.6, seed=0)
    stats = pearson_with_bootstrap(x, y, groups, num_resamples=200, seed=0)
    assert stats.pearson == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-10)
    assert stats.ci_low <= stats.pearson <= stats.ci_high


def test_bootstrap_ci_covers_truth_and_narrows_with_n():
    rho = 0.6
    covered, widths_small, widths_large = 0, [], []
    for seed in range(20):
        x, y, groups = _correlated_groups(300, rho, seed=seed)
        small = pearson_with_bootstrap(x, y, groups, num_resamples=500, seed=seed)
        covered += small.ci_low <= rho <= small.ci_high
        widths_small.append(small.ci_high - small.ci_low)
        x, y, groups = _correlated_groups(3000, rho, seed=100 + seed)
        large = pearson_with_bootstrap(x, y, groups, num_resamples=500, seed=seed)
        widths_large.append(large.ci_high - large.ci_low)
    # A 95% interval: 20 replications cover the truth at least 16 times except with probability < 1.6%.
    assert covered >= 16
    # 10x the groups: the width shrinks by about sqrt(10) ~ 3.2.
    assert 2.0 < np.mean(widths_small) / np.mean(widths_large) < 5.0


def test_bootstrap_resamples_groups_not_points():
    # Few groups with many copies each: a point bootstrap pretends to have 40x the data.
    x, y, groups = _correlated_groups(60, 0.5, seed=3)
    x, y, groups = np.repeat(x, 40), np.repeat(y, 40), np.repeat(groups, 40)
    clustered = pearson_with_bootstrap(x, y, groups, num_resamples=500, seed=0)
    naive = pearson_with_bootstrap(x, y, None, num_resamples=500, seed=0)
    assert clustered.pearson == pytest.approx(naive.pearson)
    assert (clustered.ci_high - clustered.ci_low) > 3 * (naive.ci_high - naive.ci_low)


def test_bootstrap_is_seeded_and_degenerate_inputs_give_nan():
    x, y, groups = _correlated_groups(100, 0.3, seed=1)
    assert pearson_with_bootstrap(x, y, groups, 200, seed=7) == pearson_with_bootstrap(
        x, y, groups, 200, seed=7
    )
    assert pearson_with_bootstrap(x, y, groups, 200, seed=7) != pearson_with_bootstrap(
        x, y, groups, 200, seed=8
    )
    constant = pearson_with_bootstrap(np.full(50, 2.0), np.arange(50.0), np.arange(50), 100, seed=0)
    assert all(math.isnan(v) for v in constant)
    single = pearson_with_bootstrap([1.0], [2.0], [0], 100)
    assert math.isnan(single.pearson)
    # A perfect linear relation stays at 1 in every resample.
    exact = pearson_with_bootstrap(np.arange(30.0), 2 * np.arange(30.0) + 1, np.arange(30) // 3, 100)
    assert exact == pytest.approx((1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="same length"):
        pearson_with_bootstrap([1.0, 2.0], [1.0], None)


# --------------------------------------------------------------------------------------------------
# Span picking
# --------------------------------------------------------------------------------------------------
def test_segment_anchors_rule():
    boundaries = torch.tensor([True, False, True, False, False, True, True, False, True])
    # boundaries[0] is irrelevant (0 is always an anchor); positions >= length are ignored.
    assert segment_anchors(boundaries, 7) == [0, 2, 5, 6, 7]
    assert segment_anchors(boundaries, 1) == [0, 1]
    assert segment_anchors([False] * 4, 4) == [0, 4]


def test_pick_spans_are_distinct_whole_segments_and_seeded():
    boundaries = torch.zeros(40, dtype=torch.bool)
    boundaries[[3, 7, 8, 15, 22, 30]] = True
    anchors = segment_anchors(boundaries, 35)
    segments = set(pairwise(anchors))
    spans = pick_spans(boundaries, 35, 4, np.random.default_rng(0))
    assert len(spans) == 4 and spans == sorted(spans)
    assert set(spans) <= segments  # both ends are anchors and consecutive: one whole segment
    assert len(set(spans)) == 4  # no span twice, hence no token with two A*
    assert spans == pick_spans(boundaries, 35, 4, np.random.default_rng(0))
    draws = {tuple(pick_spans(boundaries, 35, 2, np.random.default_rng(s))) for s in range(30)}
    assert len(draws) > 5  # actually random
    # Asking for more spans than segments returns every segment: they tile the response.
    everything = pick_spans(boundaries, 35, 100, np.random.default_rng(0))
    assert everything == sorted(segments)
    assert [t for a, b in everything for t in range(a, b)] == list(range(35))


# --------------------------------------------------------------------------------------------------
# Monte-Carlo state values
# --------------------------------------------------------------------------------------------------
def _prompt_only_reward(prompts, completions, completion_ids, value, **kwargs):
    return [float(v) for v in value]


def test_monte_carlo_value_is_exact_when_reward_depends_only_on_prompt(tiny_model, tokenizer):
    rows = [{"prompt": "Add: 1 2", "value": 0.25}, {"prompt": "xyz", "value": -1.5}]
    prompt_ids = [_encode_prompt(tokenizer, r["prompt"]) for r in rows]
    prefix_a = tokenizer("ab", add_special_tokens=False)["input_ids"]
    mc = monte_carlo_values(
        tiny_model,
        tokenizer,
        rows=[rows[0], rows[1], rows[0], rows[1]],
        prompt_ids=[prompt_ids[0], prompt_ids[1], prompt_ids[0], prompt_ids[1]],
        prefix_ids=[[], prefix_a, prefix_a, []],
        budgets=[6, 4, 0, 6],  # the third state has no budget left: terminal
        reward_func=_prompt_only_reward,
        num_continuations=5,
        batch_size=7,  # not a multiple of K: a state's continuations straddle two calls
        show_progress=False,
    )
    np.testing.assert_array_equal(mc.values, [0.25, -1.5, 0.25, -1.5])
    np.testing.assert_array_equal(mc.num_valid, [5, 5, 1, 5])
    np.testing.assert_array_equal(mc.std, 0.0)


def test_monte_carlo_continuations_extend_the_prefix_within_budget(tiny_model, tokenizer):
    """Reward = 1 iff the completion starts with 'a': exact for states past t = 0, known in closed form
    (the policy's probability of 'a') at t = 0."""
    a_id = tokenizer.convert_tokens_to_ids("a")
    prompt = _encode_prompt(tokenizer, "Add: 1 2")
    seen = []

    def starts_with_a(prompts, completions, completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [float(len(ids) > 0 and ids[0] == a_id) for ids in completion_ids]

    prefix_a = [a_id, a_id + 1]
    prefix_b = [a_id + 1]
    temperature = 0.2
    mc = monte_carlo_values(
        tiny_model,
        tokenizer,
        rows=[{"prompt": "Add: 1 2"}] * 3,
        prompt_ids=[prompt] * 3,
        prefix_ids=[prefix_a, prefix_b, []],
        budgets=[3, 5, 1],
        reward_func=starts_with_a,
        num_continuations=400,
        temperature=temperature,
        batch_size=256,
        show_progress=False,
    )
    assert mc.values[0] == 1.0 and mc.values[1] == 0.0
    assert mc.std[0] == 0.0 and mc.std[1] == 0.0
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt])).logits[0, -1]
    p_a = torch.softmax(logits / temperature, dim=-1)[a_id].item()
    assert abs(mc.values[2] - p_a) < 4 * math.sqrt(p_a * (1 - p_a) / 400) + 1e-3
    # Every scored completion is the state's prefix followed by at most `budget` new tokens.
    eos = tokenizer.eos_token_id
    for ids in seen:
        if ids[:2] == prefix_a:
            assert len(ids) <= 2 + 3
        elif ids[:1] == prefix_b:
            assert len(ids) <= 1 + 5
        else:
            assert len(ids) == 1
        assert eos not in ids[:-1]  # generation stops at eos, padding is cut


def test_monte_carlo_prefix_cache_reuse_gives_the_same_samples(tiny_model, tokenizer):
    prompts = [_encode_prompt(tokenizer, p) for p in ("Add: 1 2", "q")]
    samples = {}
    for reuse in (True, False):
        seen = []

        def record(prompts, completions, completion_ids, seen=seen, **kwargs):
            seen.extend(tuple(c) for c in completion_ids)
            return [float(len(c)) for c in completion_ids]

        torch.manual_seed(123)
        monte_carlo_values(
            tiny_model,
            tokenizer,
            rows=[{"prompt": "p"}] * 2,
            prompt_ids=prompts,
            prefix_ids=[[5, 6, 7], []],
            budgets=[6, 6],
            reward_func=record,
            num_continuations=3,
            temperature=0.7,
            reuse_prefix_cache=reuse,
            show_progress=False,
        )
        samples[reuse] = seen
    assert samples[True] == samples[False]


def test_monte_carlo_ignores_the_checkpoints_sampling_defaults(tiny_model, tokenizer):
    # A checkpoint's generation_config fills every unset field of the one passed to generate: top_k=1
    # would make all K continuations identical, and min_new_tokens would restart at every continuation.
    tiny_model.generation_config.top_k = 1
    tiny_model.generation_config.min_new_tokens = 50
    seen = []

    def record(prompts, completions, completion_ids, **kwargs):
        seen.extend(tuple(c) for c in completion_ids)
        return [0.0] * len(completion_ids)

    monte_carlo_values(
        tiny_model,
        tokenizer,
        rows=[{"prompt": "p"}],
        prompt_ids=[_encode_prompt(tokenizer, "Add: 1 2")],
        prefix_ids=[[]],
        budgets=[4],
        reward_func=record,
        num_continuations=8,
        show_progress=False,
    )
    assert len(set(seen)) > 1


def test_monte_carlo_none_rewards_leave_the_mean(tiny_model, tokenizer):
    prompt = _encode_prompt(tokenizer, "hi")

    def sometimes_none(prompts, completions, completion_ids, flag, **kwargs):
        return [None if f == "none" else 2.0 for f in flag]

    mc = monte_carlo_values(
        tiny_model,
        tokenizer,
        rows=[{"prompt": "hi", "flag": "none"}, {"prompt": "hi", "flag": "ok"}],
        prompt_ids=[prompt, prompt],
        prefix_ids=[[], []],
        budgets=[3, 3],
        reward_func=sometimes_none,
        num_continuations=2,
        show_progress=False,
    )
    assert math.isnan(mc.values[0]) and mc.num_valid[0] == 0
    assert mc.values[1] == 2.0 and mc.num_valid[1] == 2


# --------------------------------------------------------------------------------------------------
# Critic adapter
# --------------------------------------------------------------------------------------------------
def test_critic_value_fn_values_the_state_before_each_token(tiny_critic, tokenizer):
    prompts = [_encode_prompt(tokenizer, "Add: 1 2"), _encode_prompt(tokenizer, "x")]
    completions = [[10, 11, 12, 13], [14, 15]]
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    prompt_mask = (torch.arange(width) >= torch.tensor([[width - len(p)] for p in prompts])).long()
    completion_ids = torch.tensor([completions[0], [*completions[1], pad, pad]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    values = critic_value_fn(tiny_critic)(
        torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), width
    )
    assert values.shape == (2, 4)
    backbone = tiny_critic.model
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        for t in range(len(completion)):
            # V(s_t) = head at the last position of prompt + completion[:t], computed with no padding.
            state = torch.tensor([prompt + completion[:t]])
            with torch.no_grad():
                expected = tiny_critic.score(backbone(input_ids=state).last_hidden_state)[0, -1, 0]
            assert values[i, t].item() == pytest.approx(expected.item(), abs=1e-4)


# --------------------------------------------------------------------------------------------------
# End to end on the tiny model
# --------------------------------------------------------------------------------------------------
def _contains_answer(prompts, completions, completion_ids, answer, **kwargs):
    return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]


CHAT_ROWS = [
    {"prompt": [{"role": "user", "content": f"Add: {a} {b}"}], "answer": str(a + b)[-1]}
    for a, b in [(1, 2), (3, 4), (2, 5)]
]


def test_correlate_advantages_end_to_end(tiny_model, tiny_critic, tokenizer):
    def run(seed: int) -> CorrelationResult:
        return correlate_advantages(
            tiny_model,
            tokenizer,
            CHAT_ROWS,
            _contains_answer,
            critic_value_fn(tiny_critic),
            num_trajectories=4,
            num_spans_per_trajectory=2,
            num_continuations=4,
            temperature=0.7,
            max_new_tokens=16,
            seed=seed,
            batch_size=16,
            num_bootstrap=100,
            show_progress=False,
        )

    torch.manual_seed(999)
    caller_state = torch.get_rng_state()
    result = run(seed=0)
    assert torch.equal(torch.get_rng_state(), caller_state)  # the caller's RNG is left alone
    again = run(seed=0)
    assert again.to_dict(include_arrays=True) == result.to_dict(include_arrays=True)  # seeded
    expected = (
        [("gae", f"lam={lam:g}") for lam in (0, 0.5, 0.8, 0.9, 0.95, 0.99, 1)]
        + [("sae", f"p={p:g}, lam=0.95") for p in (0.05, 0.2, 0.5, 0.9)]
        + [("adaptive_lambda", "alpha=0.2")]
    )
    assert [(r.estimator, r.setting) for r in result.rows] == expected
    n_tokens = sum(s.end - s.start for s in result.spans)
    assert 0 < len(result.spans) <= 8
    assert result.a_star.shape == result.span_ids.shape == (n_tokens,)
    for row in result.rows:
        assert row.n_tokens == n_tokens and row.n_spans == len(result.spans)
        assert result.estimates[row.label].shape == (n_tokens,)
        assert -1.0 <= row.pearson <= 1.0 or math.isnan(row.pearson)
        if not math.isnan(row.ci_low):
            assert row.ci_low <= row.pearson + 1e-9 and row.pearson <= row.ci_high + 1e-9
    for k, span in enumerate(result.spans):
        assert 0 <= span.start < span.end <= 16
        np.testing.assert_allclose(result.a_star[result.span_ids == k], span.v_end - span.v_start)
        for v in (span.v_start, span.v_end):  # 0/1 rewards over K=4 continuations: multiples of 1/4
            assert v * 4 == pytest.approx(round(v * 4))
    # Output formats.
    payload = json.loads(result.to_json(include_arrays=True))
    assert len(payload["rows"]) == 12 and len(payload["a_star"]) == n_tokens
    assert len(result.to_markdown().splitlines()) == 2 + 12
    assert result.row("sae", "p=0.2, lam=0.95").estimator == "sae"
    with pytest.raises(KeyError):
        result.row("gae")  # ambiguous without a setting


def test_correlate_prompt_only_reward_gives_zero_a_star(tiny_model, tiny_critic, tokenizer):
    rows = [{"prompt": "Add: 1 2", "value": 1.0}, {"prompt": "Add: 4 4", "value": 0.0}]
    result = correlate_advantages(
        tiny_model,
        tokenizer,
        rows,
        _prompt_only_reward,
        critic_value_fn(tiny_critic),
        num_trajectories=2,
        num_spans_per_trajectory=2,
        num_continuations=2,
        max_new_tokens=8,
        num_bootstrap=20,
        show_progress=False,
    )
    np.testing.assert_array_equal(result.a_star, 0.0)
    assert all(math.isnan(r.pearson) for r in result.rows)  # no variance in A*: undefined, not 0
    np.testing.assert_array_equal(result.trajectory_rewards, [1.0, 0.0])
    assert "n/a" in result.to_markdown()
    assert json.loads(result.to_json())["rows"][0]["pearson"] is None


# --------------------------------------------------------------------------------------------------
# Segment statistics
# --------------------------------------------------------------------------------------------------
def test_segment_stats_from_logprobs_by_hand():
    probs = torch.tensor([[0.9, 0.1, 0.6, 0.3, 0.05], [0.5, 0.02, 0.95, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    rows = segment_stats_from_logprobs(probs.log(), mask, p_grid=(0.07, 0.2, 0.7))
    # p=0.07: boundaries at t>=1 -> row0 {4}, row1 {1}: 2 boundaries, 4 segments, 8 tokens.
    assert rows[0] == SegmentStatsRow(0.07, 8 / 4, 1.0, 4.0, 2)
    # p=0.2: row0 {1, 4}, row1 {1}.
    assert rows[1] == SegmentStatsRow(0.2, 8 / 5, 1.5, 4.0, 2)
    # p=0.7: row0 {1, 2, 3, 4}, row1 {1} (0.95 not below, t=0 never counts).
    assert rows[2] == SegmentStatsRow(0.7, 8 / 7, 2.5, 4.0, 2)


def test_segment_stats_vs_threshold_monotone_in_p(tiny_model, tokenizer):
    rows = segment_stats_vs_threshold(
        tiny_model,
        tokenizer,
        ["Add: 1 2", [{"role": "user", "content": "hi"}]],
        num_samples=8,
        temperature=0.2,  # the random tiny model is near-uniform at 1.0: every token would be a boundary
        max_new_tokens=24,
        seed=0,
        show_progress=False,
    )
    assert [r.p for r in rows] == [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9]
    counts = [r.boundaries_per_completion for r in rows]
    lengths = [r.mean_segment_length for r in rows]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] < lengths[0]
    assert len({r.mean_completion_length for r in rows}) == 1  # one set of completions for every p
    assert all(r.num_completions == 8 for r in rows)


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------
def _synthetic_result() -> CorrelationResult:
    rows = [
        CorrelationRow("gae", f"lam={lam:g}", 0.2 + 0.3 * lam, 0.1 + 0.3 * lam, 0.3 + 0.3 * lam, 50, 10)
        for lam in (0.0, 0.5, 0.9, 1.0)
    ]
    rows += [CorrelationRow("sae", f"p={p:g}, lam=0.95", 0.6, 0.5, 0.7, 50, 10) for p in (0.2, 0.5)]
    rows += [CorrelationRow("adaptive_lambda", "alpha=0.2", 0.4, math.nan, math.nan, 50, 10)]
    return CorrelationResult(
        rows=rows,
        a_star=np.zeros(50),
        estimates={},
        span_ids=np.repeat(np.arange(10), 5),
        spans=[SpanRecord(0, 5 * k, 5 * k + 5, 0.0, 0.0) for k in range(10)],
        trajectory_rewards=np.zeros(1),
        config={"confidence": 0.95},
    )


def test_plots_write_non_empty_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    corr = plot_correlations(_synthetic_result(), tmp_path / "corr.png")
    seg = plot_segment_stats(
        [SegmentStatsRow(p, 10 / p, 3 * p, 30.0, 8) for p in (0.05, 0.2, 0.5)]
        + [{"p": 0.9, "mean_segment_length": 2.0, "boundaries_per_completion": 9.0}],
        tmp_path / "sub" / "seg.png",
    )
    for path in (corr, seg):
        with open(path, "rb") as handle:
            data = handle.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plots_without_matplotlib_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"trl-sae\[plots\]"):
        plot_correlations(_synthetic_result(), tmp_path / "x.png")


def test_segment_stats_keeps_each_submodules_mode(tiny_model, tokenizer):
    # A model can hold modules in both modes (from_pretrained loads in eval, peft adds adapters in train);
    # sampling for an analysis must hand every submodule back in the mode it had, not the top module's.
    tiny_model.train()
    tiny_model.model.layers[0].eval()
    tiny_model.lm_head.eval()
    before = {name: module.training for name, module in tiny_model.named_modules()}
    assert len(set(before.values())) == 2
    segment_stats_vs_threshold(
        tiny_model, tokenizer, ["Add: 1 2"], num_samples=2, max_new_tokens=4, seed=0, show_progress=False
    )
    after = {name: module.training for name, module in tiny_model.named_modules()}
    assert [name for name in before if before[name] != after[name]] == []
