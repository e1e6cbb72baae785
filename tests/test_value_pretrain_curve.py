"""benchmarks/value_pretrain_curve.py's arguments and pure helpers, on tiny tensors (no model, offline)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "value_pretrain_curve.py"
sys.path.insert(0, str(SCRIPT.parent))
_spec = importlib.util.spec_from_file_location("value_pretrain_curve_bench", SCRIPT)
curve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(curve)


def test_defaults_and_sizes():
    args = curve.parse_args([])
    assert (args.seed, args.rollouts, args.held_out) == (100, 256, 64)
    assert args.sizes == [32, 64, 128, 256]
    assert args.fits == list(curve.FITS)
    assert args.work_dir == args.output_dir / "work"
    assert curve.default_sizes(96) == [32, 64, 96]
    assert curve.parse_args(["--sizes", "64", "8", "64", "--fits"]).sizes == [8, 64]
    assert curve.parse_args(["--fits"]).fits == []


def test_the_task_is_the_long_one_unless_a_chain_is_given():
    long_task = curve.gym_args(curve.parse_args([]))
    assert long_task.long_task and long_task.worked_steps and long_task.response_length == 128
    chain = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
    args = curve.parse_args(["--task-config", json.dumps(chain), "--response-length", "64", "--seed", "101"])
    other = curve.gym_args(args)
    assert (other.long_task, other.worked_steps, other.task_config, other.response_length) == (
        False,
        True,
        chain,
        64,
    )
    assert (other.seed, other.eval_size) == (101, 16)
    assert (
        other.lora_layers is None
        and curve.gym_args(curve.parse_args(["--lora-layers", "10"])).lora_layers == 10
    )


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("head-last-lr1e-3", ("head", None, 1e-3)),
        ("head-l20-lr3e-4", ("head", 20, 3e-4)),
        ("shared-lr5e-4", ("shared", None, 5e-4)),
        ("head-l0-lr0.01", ("head", 0, 0.01)),
    ],
)
def test_fit_names_say_the_critic_its_layer_and_learning_rate(name, parsed):
    assert curve.parse_fit(name) == parsed
    assert curve.parse_args(["--fits", name]).fits == [name]


@pytest.mark.parametrize("name", ["head-lr1e-3", "shared-l3-lr1e-3", "head-last-lr0", "head-last", "gae-lr1"])
def test_other_fit_names_are_refused(name, capsys):
    with pytest.raises(SystemExit):
        curve.parse_args(["--fits", name])
    assert "head-l<layer>-lr<lr>" in capsys.readouterr().err


def test_an_interrupted_fit_is_continued_and_a_finished_one_is_not(tmp_path):
    folder = tmp_path / "value_pretrain"
    assert curve.interrupted_epochs(tmp_path) == []  # never ran
    for epoch in (1, 2):
        (folder / f"progress-epoch-{epoch}").mkdir(parents=True)
        (folder / f"progress-epoch-{epoch}" / "progress.json").write_text("{}")
    (folder / "progress-epoch-3").mkdir()  # staged, never finished: no progress.json
    assert curve.interrupted_epochs(tmp_path) == [1, 2]
    (folder / "value_pretrain.json").write_text("{}")
    assert curve.interrupted_epochs(tmp_path) == []  # finished: a new fit starts over


def test_a_fits_file_and_folder_name_its_lora_when_not_every_layer(tmp_path):
    args = curve.parse_args(["--rollouts", "64", "--output-dir", str(tmp_path)])
    assert curve.fit_label(args, "head-l20-lr1e-3") == "head-l20-lr1e-3-n64"
    lora = curve.parse_args(["--rollouts", "64", "--lora-layers", "10", "--output-dir", str(tmp_path)])
    assert (
        curve.fit_folder(lora, "head-l20-lr1e-3")
        == tmp_path / "work" / "seed-100" / "fit-head-l20-lr1e-3-n64-lora10"
    )


def test_between_prompt_share_separates_prompt_difficulty_from_luck():
    # every completion of a prompt scores alike: all of the variance lies between prompts
    assert curve.between_prompt_share(torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0]), 4) == pytest.approx(1.0)
    # every prompt has the same mix: none of it does (the groups' means agree exactly)
    assert curve.between_prompt_share(torch.tensor([1.0, 0, 0, 0, 0, 1, 0, 0]), 4) == 0.0
    # many prompts whose pass rates are 0.2 and 0.6: between = 0.04, within = mean(0.16, 0.24) = 0.2 -> 1/6
    generator = torch.Generator().manual_seed(0)
    rates = torch.tensor([0.2, 0.6]).repeat(4000)
    scores = (torch.rand(8000, 50, generator=generator) < rates[:, None]).float().view(-1)
    assert curve.between_prompt_share(scores, 50) == pytest.approx(1 / 6, abs=0.01)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", "0"], "tuning seeds only"),
        (["--rollouts", "48"], "--rollouts 48"),
        (["--held-out", "0"], "--held-out 0"),
        (["--sizes", "6"], "--sizes [6]"),
        (["--rollouts", "64", "--sizes", "128"], "--sizes [128]"),
        (["--epochs", "0"], "--epochs"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        curve.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bank_statistics_counts():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # two prompts of 4: one mixed
    mask = torch.tensor([[1, 1, 1, 0]] * 4 + [[1, 1, 0, 0]] * 4)
    boundaries = torch.zeros(8, 4, dtype=torch.bool)
    boundaries[:, 0] = True
    boundaries[0, 3] = True  # on padding: not counted
    stats = curve.bank_statistics(scores, mask, boundaries, num_generations=4)
    assert stats["pass_rate"] == pytest.approx(1 / 8)
    assert stats["mixed_prompts"] == pytest.approx(0.5)
    assert stats["mean_completion_tokens"] == pytest.approx(2.5)
    assert stats["mean_boundaries"] == pytest.approx(1.0)
    assert (stats["prompts"], stats["completions"]) == (2, 8)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_ridge_recovers_a_linear_target(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 5, generator=generator) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0])
    w = torch.randn(5, generator=generator)
    y = x @ w + 2.0
    model = curve.ridge_fit(x, y, alpha=1e-6)
    held = torch.randn(50, 5, generator=generator)
    assert torch.allclose(curve.ridge_predict(model, held), held @ w + 2.0, atol=1e-3)
    assert curve.token_ev(curve.ridge_predict(model, held), held @ w + 2.0) == pytest.approx(1.0, abs=1e-4)


def test_ridge_strength_shrinks_to_the_mean():
    x = torch.randn(100, 3, generator=torch.Generator().manual_seed(0))
    y = x[:, 0] + 5.0
    flat = curve.ridge_predict(curve.ridge_fit(x, y, alpha=1e9), x)
    assert torch.allclose(flat, torch.full_like(flat, float(y.mean())), atol=1e-3)


def test_token_ev_is_one_minus_the_residual_share():
    targets = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert curve.token_ev(torch.full((4,), 0.5), targets) == pytest.approx(0.0)
    assert curve.token_ev(torch.tensor([0.25, 0.75, 0.25, 0.75]), targets) == pytest.approx(0.75)


def test_choose_alpha_prefers_little_shrinkage_on_a_clean_signal_and_never_reads_past_n():
    generator = torch.Generator().manual_seed(1)
    rollout_of = torch.arange(64).repeat_interleave(5)  # 64 rollouts of 5 tokens
    x = torch.randn(len(rollout_of), 4, generator=generator)
    y = x @ torch.tensor([1.0, -1.0, 0.5, 0.0])
    assert curve.choose_alpha(x, y, rollout_of, n=32, group=4) == min(curve.RIDGE_ALPHAS)
    # Rollouts past n carry noise: the choice for n=32 must not change.
    noisy = y.clone()
    noisy[rollout_of >= 32] = torch.randn(int((rollout_of >= 32).sum()), generator=generator) * 100
    assert curve.choose_alpha(x, noisy, rollout_of, n=32, group=4) == min(curve.RIDGE_ALPHAS)


def test_report_renders_every_stage(tmp_path):
    stats = {
        "completions": 8, "prompts": 2, "pass_rate": 0.125, "mixed_prompts": 0.5, "mean_score": 0.125,
        "mean_completion_tokens": 38.0, "mean_boundaries": 3.5, "mean_prompt_tokens": 200.0, "truncated": 0.0,
    }  # fmt: skip
    results = [
        {"stage": "bank", "seed": 100, "rollouts": 32, "held_out": 32, "segmentation": "probability",
         "segment_threshold": 0.2, "sampling_seconds": 64.0, "rollouts_per_second": 1.0,
         "statistics": {"fit": stats, "held_out": stats}},
        {"stage": "probe", "seed": 100, "sizes": [32], "held_out_tokens": 1000, "held_out_return_variance": 0.05,
         "forward_seconds": 10.0, "seconds": 12.0,
         "layers": [{"layer": 0, "ev": {"32": 0.01}}, {"layer": 1, "ev": {"32": 0.2}}]},
        {"stage": "fit", "seed": 100, "critic": "head-last-lr1e-3", "value_model": "head", "value_head_layer": None,
         "learning_rate": 1e-3, "rollouts": 32, "explained_variance_held_out": [0.0, 0.05, 0.07],
         "r2_held_out": [-0.3, 0.04, 0.06],
         "best_epoch": 2, "seconds_per_epoch": 30.0},
        {"stage": "fit", "seed": 100, "critic": "shared-lr5e-4", "value_model": "shared", "value_head_layer": None,
         "learning_rate": 5e-4, "rollouts": 32, "explained_variance_held_out": [0.0, 0.1], "lora_layers": 10,
         "best_epoch": 1, "seconds_per_epoch": 40.0},
        {"stage": "fit", "seed": 100, "critic": "shared-lr5e-4", "value_model": "shared", "value_head_layer": None,
         "learning_rate": 5e-4, "rollouts": 64, "explained_variance_held_out": [0.0, 0.2],
         "best_epoch": 1, "seconds_per_epoch": 80.0},
    ]  # fmt: skip
    text = curve.report(results)
    assert "| 100 | shared-lr5e-4 | LoRA trunk, last 10 layers | 0.0005 | 32 |" in text
    assert (
        "| 100 | shared-lr5e-4 | LoRA trunk, every layer | 0.0005 | 64 | 0.000, 0.200 | not recorded |"
        in text
    )
    assert "| fit | 8 | 2 | 0.125 | 0.500 | 38.0 | 0.000 | 3.50 |" in text
    assert "| 1 (best) | 0.200 |" in text
    assert (
        "| 100 | head-last-lr1e-3 | last | 0.001 | 32 | 0.000, 0.050, 0.070 | -0.300, 0.040, 0.060 | 2 | 30 |"
        in text
    )
    for index, result in enumerate(results):
        (tmp_path / f"{result['stage']}-{index}.json").write_text(json.dumps(result))
    assert curve.write_report(tmp_path).read_text() == text


def test_layer_states_read_the_state_before_each_valid_completion_token_despite_padding():
    from trl_sae.demo.tiny import build_tiny_qwen3
    from trl_sae.trainer.critics.head import rms_normalise

    model = build_tiny_qwen3(num_layers=3).float()
    pad = 0
    prompts = [[5, 6, 7, 20], [5, 6, 9]]  # a common prefix of 2, run once through the cache
    completions = [[10, 11, 12], [13]]
    part = {  # left-padded prompts, right-padded completions, as the bank keeps them
        "prompt_ids": torch.tensor([[5, 6, 7, 20], [pad, 5, 6, 9]]),
        "prompt_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]),
        "completion_ids": torch.tensor([[10, 11, 12], [13, pad, pad]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "returns": torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]),
    }
    states, returns, rollout_of = curve.layer_states(model, part)
    assert len(states) == 3 and all(s.shape == (4, 64) for s in states)
    assert returns.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert rollout_of.tolist() == [0, 0, 0, 1]
    assert curve.common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert curve.common_prefix([[1], [2]]) == 0
    token = 0
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        for t in range(len(completion)):
            position = len(prompt) - 1 + t  # the state before completion token t
            assert torch.allclose(states[-1][token], hidden[-1][0, position], atol=1e-4)
            assert torch.allclose(states[1][token], rms_normalise(hidden[2][0, position]), atol=1e-4)
            token += 1


def test_probe_layers_finds_the_layer_that_carries_the_return():
    generator = torch.Generator().manual_seed(0)
    rollout_of = torch.arange(64).repeat_interleave(3)
    held_of = torch.arange(16).repeat_interleave(3)
    signal = torch.randn(len(rollout_of), 4, generator=generator)
    held_signal = torch.randn(len(held_of), 4, generator=generator)
    weights = torch.tensor([1.0, 0.5, -1.0, 0.0])
    noise = [torch.randn(len(rollout_of), 4, generator=generator), signal]  # layer 1 carries it
    held_noise = [torch.randn(len(held_of), 4, generator=generator), held_signal]
    fit = (noise, signal @ weights, rollout_of)
    held = (held_noise, held_signal @ weights, held_of)
    layers = curve.probe_layers(fit, held, sizes=[16, 64], group=4)
    assert [row["layer"] for row in layers] == [0, 1]
    assert layers[1]["ev"]["64"] > 0.99 and layers[0]["ev"]["64"] < 0.2
    assert set(layers[0]["alpha"]) == {"16", "64"}
    assert layers[1]["cv_ev"] > 0.99 and layers[0]["cv_ev"] < 0.2


def test_cross_validation_predicts_each_fold_from_the_others():
    generator = torch.Generator().manual_seed(2)
    rollout_of = torch.arange(32).repeat_interleave(2)
    x = torch.randn(64, 3, generator=generator)
    y = x @ torch.tensor([1.0, 2.0, -1.0])
    assert curve.cross_validated_ev(x, y, rollout_of, group=4) > 0.99
    # A target that is each prompt's own constant and unrelated to the features: nothing carries to other prompts.
    per_prompt = torch.randn(8, generator=generator)[rollout_of // 4]
    assert curve.cross_validated_ev(x, per_prompt, rollout_of, group=4) < 0.1


def test_fit_rollouts_and_truncate_bank():
    assert curve.parse_args([]).fit_rollouts == 256
    assert curve.parse_args(["--fit-rollouts", "64"]).fit_rollouts == 64
    for bad in ("48", "512"):
        with pytest.raises(SystemExit):
            curve.parse_args(["--fit-rollouts", bad])
    saved = {
        "fit/returns": torch.arange(10.0),
        "held/returns": torch.arange(6.0),
        "seconds": torch.tensor(3.0),
    }
    cut = curve.truncate_bank(saved, 4)
    assert cut["fit/returns"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert cut["held/returns"].shape == (6,) and float(cut["seconds"]) == 3.0
