"""Every SAEPPOConfig setting is honoured or rejected: logging, evaluation, reward whitening, adapters,
gradient clipping, and a walk over every field (inherited ones included) that records which the trainer reads.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

from trl_sae import SAEPPOConfig, SAEPPOTrainer, forward_logprobs
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.trainer.config import UNSUPPORTED_FIELDS
from trl_sae.trainer.setup import distributed as setup_utils
from trl_sae.trainer.setup.distributed import (
    build_accelerator,
    configure_deepspeed_batch_sizes,
    deepspeed_batch_sizes,
    deepspeed_gradient_clipping,
)

from .test_trainer import make_config, make_dataset, make_trainer, vowel_fraction

BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def reward_logs(trainer: SAEPPOTrainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "reward/mean" in entry]


# ------------------------------------------------------------------------------------------------
# logging_steps / logging_strategy
# ------------------------------------------------------------------------------------------------
def test_logging_steps_logs_means_over_the_interval_and_the_last_step(tmp_path, tokenizer, capsys):
    every = make_trainer(tmp_path, tokenizer, max_steps=4, response_length=4)
    every.train()
    per_step = reward_logs(every)
    assert [e["step"] for e in per_step] == [1, 2, 3, 4]
    capsys.readouterr()

    sparse = make_trainer(
        tmp_path, tokenizer, max_steps=4, response_length=4, logging_steps=3, log_completions=True
    )
    sparse.train()
    logged = reward_logs(sparse)
    assert [e["step"] for e in logged] == [3, 4]  # every 3 steps, plus the last
    for entry, steps in zip(logged, ([1, 2, 3], [4])):
        for key in ("reward/mean", "loss/value", "completions/mean_length"):
            mean = sum(per_step[s - 1][key] for s in steps) / len(steps)
            assert entry[key] == pytest.approx(mean, rel=1e-6), key
        assert entry["episode"] == per_step[steps[-1] - 1]["episode"]  # a position: the latest value
    tables = capsys.readouterr().out.count("Completions at step")
    assert tables == 2  # the completions table follows logging_steps too


def test_logging_strategy_epoch_and_no(tmp_path, tokenizer):
    # 4 prompts, 2 per step: an epoch is 2 steps.
    epoch = make_trainer(
        tmp_path, tokenizer, dataset=make_dataset(n=4), max_steps=4, logging_strategy="epoch"
    )
    epoch.train()
    assert [e["step"] for e in reward_logs(epoch)] == [2, 4]
    silent = make_trainer(tmp_path, tokenizer, max_steps=2, logging_strategy="no")
    silent.train()
    assert reward_logs(silent) == []


# ------------------------------------------------------------------------------------------------
# eval_strategy / eval_steps / eval_on_start
# ------------------------------------------------------------------------------------------------
class RecordEvaluate(TrainerCallback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, dict]] = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append((state.global_step, dict(metrics)))


def make_eval_trainer(tmp_path, tokenizer, callbacks=None, dataset=None, **overrides) -> SAEPPOTrainer:
    return SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else make_dataset(),
        eval_dataset=make_dataset(n=3),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def test_eval_strategy_steps_evaluates_during_training_without_changing_it(tmp_path, tokenizer):
    recorder = RecordEvaluate()
    trainer = make_eval_trainer(
        tmp_path,
        tokenizer,
        [recorder],
        max_steps=3,
        response_length=4,
        eval_strategy="steps",
        eval_steps=2,
        eval_on_start=True,
    )
    trainer.train()
    assert [step for step, _ in recorder.seen] == [0, 2, 3]  # on start, every 2 steps, and the end
    evals = [e for e in trainer.state.log_history if "eval/reward/mean" in e]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert all(0.0 <= e["eval/reward/mean"] <= 1.0 for e in evals)
    assert recorder.seen[1][1] == {
        "eval/reward/mean": evals[1]["eval/reward/mean"],
        "eval/accuracy": evals[1]["eval/accuracy"],
    }
    # Evaluation runs on a forked RNG: the training trajectory equals a run that never evaluates.
    plain = make_eval_trainer(tmp_path, tokenizer, max_steps=3, response_length=4)
    plain.train()
    assert [e["reward/mean"] for e in reward_logs(trainer)] == [e["reward/mean"] for e in reward_logs(plain)]


def test_epoch_strategies_evaluate_and_save_at_epoch_ends(tmp_path, tokenizer):
    recorder = RecordEvaluate()
    trainer = make_eval_trainer(
        tmp_path,
        tokenizer,
        [recorder],
        dataset=make_dataset(n=4),  # 2 prompts per step: an epoch is 2 steps
        max_steps=5,
        response_length=4,
        eval_strategy="epoch",
        save_strategy="epoch",
    )
    trainer.train()
    assert [step for step, _ in recorder.seen] == [2, 4]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_evaluating_without_an_eval_dataset_fails_at_init(tmp_path, tokenizer):
    for setting in (
        {"eval_strategy": "steps", "eval_steps": 2},
        {"eval_strategy": "epoch"},
        {"eval_on_start": True},
    ):
        with pytest.raises(ValueError, match=r"SAEPPOConfig\.eval_(strategy|on_start).*eval_dataset"):
            make_trainer(tmp_path, tokenizer, **setting)


# ------------------------------------------------------------------------------------------------
# whiten_rewards
# ------------------------------------------------------------------------------------------------
def capture_batches(trainer: SAEPPOTrainer) -> list:
    batches = []
    original = trainer._compute_advantages

    def compute(batch):
        original(batch)
        batches.append(batch)

    trainer._compute_advantages = compute
    return batches


def test_whiten_rewards_scales_token_rewards_as_trl_does(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, max_steps=1, whiten_rewards=True, kl_coef=0.1)
    batches = capture_batches(trainer)
    trainer.train()
    batch = batches[0]
    mask = batch.mask
    kl = batch.logprobs - batch.ref_logprobs  # k1
    raw = -0.1 * torch.where(mask, kl, torch.zeros_like(kl))
    raw[torch.arange(raw.shape[0]), batch.lengths - 1] += batch.scores
    valid = raw[mask]
    # TRL: (r - mean) / std(r, unbiased) + mean over the valid tokens, zero elsewhere.
    expected = (valid - valid.mean()) / valid.std() + valid.mean()
    torch.testing.assert_close(batch.token_rewards[mask], expected, rtol=1e-4, atol=1e-5)
    assert batch.token_rewards[~mask].abs().sum() == 0
    assert batch.token_rewards[mask].std().item() == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.whiten_rewards"):
        make_config(tmp_path, whiten_rewards=True, advantage_estimator="grpo")


# ------------------------------------------------------------------------------------------------
# ref_adapter_name / model_adapter_name
# ------------------------------------------------------------------------------------------------
def two_adapter_policy(tokenizer):
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    policy = get_peft_model(build_tiny_qwen3(tokenizer, seed=0), LoraConfig(**lora), adapter_name="actor")
    policy.add_adapter("ref", LoraConfig(**lora, init_lora_weights=False))  # a reference unlike the base
    return policy


def test_ref_adapter_name_is_the_kl_reference_and_stays_frozen(tmp_path, tokenizer, tiny_critic):
    policy = two_adapter_policy(tokenizer)
    trainer = SAEPPOTrainer(
        model=policy,
        value_model=tiny_critic,
        reward_funcs=vowel_fraction,
        args=make_config(
            tmp_path, max_steps=1, kl_coef=0.1, model_adapter_name="actor", ref_adapter_name="ref"
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
    )
    ref_before = {n: p.detach().clone() for n, p in policy.named_parameters() if ".ref." in n}
    train_before = {n: p.detach().clone() for n, p in policy.named_parameters() if ".actor." in n}
    batches = capture_batches(trainer)
    trainer.train()
    batch = batches[0]
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    with torch.no_grad():
        policy.set_adapter("ref")
        under_ref, _ = forward_logprobs(policy, *args, temperature=1.0)
        with policy.disable_adapter():
            under_base, _ = forward_logprobs(policy, *args, temperature=1.0)
        policy.set_adapter("actor")
    mask = batch.mask
    torch.testing.assert_close(batch.ref_logprobs[mask], under_ref[mask])
    assert (batch.ref_logprobs[mask] - under_base[mask]).abs().max() > 1e-3  # not the disabled-adapter base
    named = dict(policy.named_parameters())
    assert all(torch.equal(named[n], p) for n, p in ref_before.items()), "the reference adapter moved"
    assert any(not torch.equal(named[n], p) for n, p in train_before.items()), (
        "the trained adapter did not move"
    )
    assert policy.active_adapter == "actor"


def test_adapter_names_are_checked(tmp_path, tokenizer, tiny_critic):
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.ref_adapter_name.*kl_coef"):
        make_config(tmp_path, ref_adapter_name="ref")
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.ref_adapter_name='nope' is not an adapter"):
        SAEPPOTrainer(
            model=two_adapter_policy(tokenizer),
            value_model=tiny_critic,
            reward_funcs=vowel_fraction,
            args=make_config(tmp_path, kl_coef=0.1, model_adapter_name="actor", ref_adapter_name="nope"),
            train_dataset=make_dataset(),
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.ref_adapter_name names a PEFT adapter"):
        make_trainer(tmp_path, tokenizer, kl_coef=0.1, ref_adapter_name="ref")


# ------------------------------------------------------------------------------------------------
# Gradient clipping
# ------------------------------------------------------------------------------------------------
def policy_after_one_step(tmp_path, tokenizer, **overrides) -> dict[str, torch.Tensor]:
    trainer = make_trainer(tmp_path, tokenizer, max_steps=1, **overrides)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def test_max_grad_norm_zero_means_no_clipping_as_in_transformers(tmp_path, tokenizer):
    unclipped = policy_after_one_step(tmp_path, tokenizer, max_grad_norm=None)
    zero = policy_after_one_step(tmp_path, tokenizer, max_grad_norm=0.0)
    assert all(torch.equal(unclipped[n], zero[n]) for n in unclipped)


def test_deepspeed_clipping_follows_max_grad_norm(tmp_path, tokenizer):
    assert deepspeed_gradient_clipping("auto", 1.0) == 1.0
    assert deepspeed_gradient_clipping(None, 0.5) == 0.5  # a DeepSpeed json without the key
    assert deepspeed_gradient_clipping("auto", None) == 0.0  # DeepSpeed's 0 = no clipping
    assert deepspeed_gradient_clipping("auto", 0.0) == 0.0
    assert deepspeed_gradient_clipping(0.5, 0.5) == 0.5
    with pytest.raises(ValueError, match=r"gradient_clipping=2.0 but SAEPPOConfig.max_grad_norm=1.0"):
        deepspeed_gradient_clipping(2.0, 1.0)
    # The shipped ZeRO configs set no gradient_clipping: accelerate's plugin then holds "auto", which it would
    # fill with 1.0 whatever max_grad_norm says; the trainer writes max_grad_norm into the plugin's config.
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2)
    assert plugin.deepspeed_config["gradient_clipping"] == "auto"
    trainer = make_trainer(tmp_path, tokenizer, max_grad_norm=0.3)
    trainer.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
    trainer._setup_deepspeed_clipping()
    assert plugin.deepspeed_config["gradient_clipping"] == 0.3


def deepspeed_accelerator(
    plugin, num_processes: int, gradient_accumulation_steps: int = 1
) -> SimpleNamespace:
    """What configure_deepspeed_batch_sizes reads of an Accelerator (DeepSpeed itself is not installed)."""
    return SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=plugin),
        num_processes=num_processes,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )


def ds_sizes(micro: int, accumulation: int) -> dict[str, int]:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation}


def test_deepspeed_batch_sizes_fill_auto_with_one_step_per_mini_batch(tmp_path, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    # The shipped ZeRO yamls: accelerate's plugin leaves all three "auto", and prepare() would stop, as the
    # trainer passes it no dataloader to take a batch size from.
    plugin = DeepSpeedPlugin(zero_stage=2)
    assert [plugin.deepspeed_config[key] for key in BATCH_KEYS] == ["auto"] * 3
    # 4 rows x 4 = 16 rows per process, 2 mini-batches of 8 = 2 micro-batches of 4 per optimizer step.
    args = make_config(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=4, num_mini_batches=2
    )
    accelerator = deepspeed_accelerator(plugin, num_processes=2, gradient_accumulation_steps=4)
    configure_deepspeed_batch_sizes(accelerator, args)
    config = plugin.deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (4, 2)
    assert "train_batch_size" not in config  # DeepSpeed derives 4 x 2 x its data-parallel size
    # PPOUpdate's backward multiplies by the Accelerator's count to undo DeepSpeed's division: same count.
    assert accelerator.gradient_accumulation_steps == 2

    auto = dict.fromkeys(BATCH_KEYS, "auto")
    # 8 x 3 = 24 rows, 2 mini-batches of 12 = micro-batches of 8 and 4: two backwards per step.
    uneven = make_config(
        tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=3, num_mini_batches=2
    )
    assert deepspeed_batch_sizes(auto, uneven, world_size=1) == ds_sizes(8, 2)
    # The paper's recipe: 8 rows x 64 = 512 per GPU, one mini-batch, 8 GPUs; keys absent from the json.
    paper = make_config(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=64)
    assert deepspeed_batch_sizes({}, paper, world_size=8) == ds_sizes(8, 64)
    assert deepspeed_batch_sizes({"train_batch_size": 4096}, paper, world_size=8) == ds_sizes(8, 64)

    # Token budget: a varying number of micro-batches, declared as one row each, so train_batch_size is the
    # step's rows and the count is > 1 (DeepSpeed < 0.19 accumulates offloaded ZeRO-1/2 grads only then).
    monkeypatch.setattr(setup_utils, "_accelerate_sets_deepspeed_boundary", lambda: True)
    budget = make_config(
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_mini_batches=2,
        max_tokens_per_microbatch=64,
    )
    assert deepspeed_batch_sizes(auto, budget, world_size=2) == ds_sizes(1, 8)
    # Before accelerate 1.8 DeepSpeed steps after a fixed count of backwards: a token budget has none.
    monkeypatch.setattr(setup_utils, "_accelerate_sets_deepspeed_boundary", lambda: False)
    with pytest.raises(
        ValueError, match=r"max_tokens_per_microbatch=64 under DeepSpeed needs accelerate >= 1.8"
    ):
        deepspeed_batch_sizes(auto, budget, world_size=2)


def test_deepspeed_batch_sizes_reject_conflicting_explicit_values(tmp_path, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    args = make_config(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=4, num_mini_batches=2
    )
    zero2 = {"zero_optimization": {"stage": 2}}
    for key, value, wanted in (
        ("train_micro_batch_size_per_gpu", 8, 4),
        ("gradient_accumulation_steps", 4, 2),  # the rollout's 4, not the 2 micro-batches per step
        ("train_batch_size", 32, 16),  # 4 rows x 2 micro-batches x 2 processes
    ):
        plugin = DeepSpeedPlugin(hf_ds_config={**zero2, key: value})
        message = (
            rf"DeepSpeed config sets {key}={value} but SAEPPOTrainer needs {key}={wanted} .*{key} to 'auto'"
        )
        with pytest.raises(ValueError, match=message):
            configure_deepspeed_batch_sizes(deepspeed_accelerator(plugin, num_processes=2), args)
        assert plugin.deepspeed_config[key] == value  # not overwritten
    # Values that agree pass. A json without gradient_accumulation_steps reaches us as accelerate's 1, which
    # cannot be told from an explicit 1, so 1 is taken as unset and replaced.
    plugin = DeepSpeedPlugin(
        hf_ds_config={**zero2, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 16}
    )
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    configure_deepspeed_batch_sizes(deepspeed_accelerator(plugin, num_processes=2), args)
    assert [plugin.deepspeed_config[key] for key in BATCH_KEYS] == [4, 2, 16]


def test_deepspeed_batch_sizes_leave_a_run_without_deepspeed_alone(tmp_path):
    args = make_config(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=4, num_mini_batches=2
    )
    accelerator = build_accelerator(args)
    assert getattr(accelerator.state, "deepspeed_plugin", None) is None
    configure_deepspeed_batch_sizes(accelerator, args)
    assert accelerator.gradient_accumulation_steps == 4  # SAEPPOConfig's, as before


def test_a_conflicting_deepspeed_batch_size_stops_the_trainer_before_the_model_loads(tmp_path):
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}
    )
    trainer_module = importlib.import_module("trl_sae.trainer.sae_ppo_trainer")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "build_accelerator", lambda args: deepspeed_accelerator(plugin, 1))
        # The model path does not exist: the DeepSpeed check must fail first, not minutes into loading.
        with pytest.raises(
            ValueError, match=r"train_micro_batch_size_per_gpu=2 but SAEPPOTrainer needs .*=4"
        ):
            SAEPPOTrainer(
                model=str(tmp_path / "no-such-model"),
                reward_funcs=vowel_fraction,
                args=make_config(tmp_path, per_device_train_batch_size=4),
                train_dataset=make_dataset(),
            )


# ------------------------------------------------------------------------------------------------
# Bad values fail in the config
# ------------------------------------------------------------------------------------------------
def test_nan_and_inf_are_rejected_for_every_float_field(tmp_path):
    float_fields = [
        f.name
        for f in dataclasses.fields(SAEPPOConfig)
        if isinstance(f.default, float) and f.name not in UNSUPPORTED_FIELDS
    ]
    assert {"temperature", "learning_rate", "max_grad_norm", "segment_threshold", "kl_coef"} <= set(
        float_fields
    )
    for name in float_fields:
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(ValueError, match=rf"SAEPPOConfig\.{name}: must be finite"):
                make_config(tmp_path, **{name: bad})
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.reward_weights: must be finite"):
        make_config(tmp_path, reward_weights=[1.0, math.inf])


@pytest.mark.parametrize("scheduler", ["reduce_lr_on_plateau", "greedy"])
def test_metric_stepped_lr_schedulers_are_rejected_in_the_config(tmp_path, scheduler):
    # The PPO update steps its scheduler with no metric; these schedulers need one (a TypeError after update 1).
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError):
        get_scheduler(scheduler, optimizer).step()
    with pytest.raises(
        ValueError, match=rf"SAEPPOConfig\.lr_scheduler_type='{scheduler}' is not supported.*'cosine'"
    ):
        make_config(tmp_path, lr_scheduler_type=scheduler)
    assert make_config(tmp_path, lr_scheduler_type="cosine").lr_scheduler_type == "cosine"


def test_honoured_trainer_settings_reach_the_accelerator_and_the_data_order(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, ddp_bucket_cap_mb=50, ddp_find_unused_parameters=True)
    handler = trainer.accelerator.ddp_handler
    assert handler.bucket_cap_mb == 50 and handler.find_unused_parameters is True
    plain = make_trainer(tmp_path, tokenizer)
    reseeded = make_trainer(tmp_path, tokenizer, data_seed=7)
    same = make_trainer(tmp_path, tokenizer, data_seed=0)  # seed is 0 in make_config
    assert reseeded.rollouts.prompt_indices(0) != plain.rollouts.prompt_indices(0)
    assert same.rollouts.prompt_indices(0) == plain.rollouts.prompt_indices(0)
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.ddp_find_unused_parameters=False"):
        make_trainer(tmp_path, tokenizer, ddp_find_unused_parameters=False, value_warmup_steps=1)


# ------------------------------------------------------------------------------------------------
# The walk: every field is honoured (read by the trainer while set) or rejected
# ------------------------------------------------------------------------------------------------
# A non-default value for each rejected field: setting it must raise an error naming the field.
REJECTED_VALUES: dict[str, object] = {
    "accelerator_config": {"split_batches": True},
    "auto_find_batch_size": True,
    "average_tokens_across_devices": False,
    "batch_eval_metrics": True,
    "bf16_full_eval": True,
    "fp16_full_eval": True,
    "dataloader_drop_last": True,
    "dataloader_in_order": False,
    "dataloader_multiprocessing_context": "spawn",
    "dataloader_num_workers": 2,
    "dataloader_persistent_workers": True,
    "dataloader_pin_memory": False,
    "dataloader_prefetch_factor": 2,
    "train_sampling_strategy": "sequential",
    "length_column_name": "n",
    "remove_unused_columns": False,
    "label_names": ["labels"],
    "label_smoothing_factor": 0.1,
    "prediction_loss_only": True,
    "eval_accumulation_steps": 2,
    "eval_do_concat_batches": False,
    "eval_use_gather_object": True,
    "include_for_metrics": ["inputs"],
    "load_best_model_at_end": True,
    "metric_for_best_model": "eval/reward/mean",
    "greater_is_better": True,
    "debug": "underflow_overflow",
    "deepspeed": "ds_config.json",
    "fsdp": "full_shard",
    "fsdp_config": {"min_num_params": 1},
    "parallelism_config": {"tp_size": 2},
    "do_train": True,
    "do_eval": True,
    "do_predict": True,
    "enable_jit_checkpoint": True,
    "hub_strategy": "checkpoint",
    "hub_always_push": True,
    "ignore_data_skip": True,
    "restore_callback_states_from_checkpoint": True,
    "save_only_model": True,
    "include_num_input_tokens_seen": "all",
    "logging_nan_inf_filter": False,
    "neftune_noise_alpha": 5.0,
    "optim_target_modules": ["q_proj"],
    "skip_memory_metrics": False,
    "torch_compile": True,
    "torch_compile_backend": "inductor",
    "torch_compile_mode": "default",
    "torch_empty_cache_steps": 10,
    "use_cache": True,
    "use_liger_kernel": True,
    "liger_kernel_config": {"rope": True},
    "num_sample_generations": 2,
    "reward_model_path": "some/rm",
    "sft_model_path": "some/sft",
    "local_rank": 0,
    "world_size": 2,
    "num_total_batches": 10,
    "micro_batch_size": 8,
    "local_batch_size": 8,
    "batch_size": 8,
    "local_mini_batch_size": 8,
    "mini_batch_size": 8,
}

# Honoured, but the reads happen outside the recorded trainer run; each is checked mechanically below.
HONOURED_WHILE_THE_CONFIG_IS_BUILT = {
    "activation_checkpointing": "TrainingArguments copies it into gradient_checkpointing (read by the trainer)",
    "activation_checkpointing_kwargs": "TrainingArguments copies it into gradient_checkpointing_kwargs",
    "tf32": "TrainingArguments.__post_init__ switches CUDA TF32 matmuls (GPU only)",
    "ddp_backend": "TrainingArguments._setup_devices starts the process group that the Accelerator reuses",
    "ddp_timeout": "TrainingArguments._setup_devices starts the process group that the Accelerator reuses",
}
HONOURED_BY_REPORTING_INTEGRATIONS = {  # read by transformers' WandbCallback, TrackioCallback, ... (report_to)
    "run_name",
    "project",
    "trackio_space_id",
    "trackio_bucket_id",
    "trackio_static_space_id",
}

# Bulk readers (serialising the whole config) do not count as using a field.
_BULK_READERS = {"to_dict", "to_json_string", "to_sanitized_dict", "__repr__", "__str__", "asdict", "replace"}


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SAEPPOConfig))


class RecordingConfig(SAEPPOConfig):
    """An SAEPPOConfig that adds the name of every field the code reads to ``self._reads`` (bulk
    serialisation aside). Module-level so that saving it (``training_args.bin``) can pickle it."""

    def __getattribute__(self, name):
        if name in _FIELD_NAMES:
            frame, bulk = sys._getframe(1), False
            for _ in range(3):  # a dict comprehension inside to_dict is one frame deeper
                if frame is None:
                    break
                bulk = bulk or frame.f_code.co_name in _BULK_READERS
                frame = frame.f_back
            if not bulk:
                object.__getattribute__(self, "_reads").add(name)
        return object.__getattribute__(self, name)


def record_reads(config: SAEPPOConfig, reads: set[str]) -> None:
    """From now on, record in ``reads`` the fields read on ``config`` (its own construction is not counted)."""
    config._reads = reads
    config.__class__ = RecordingConfig


class FakeHub:
    """Stands in for huggingface_hub's HfApi so push_to_hub runs offline."""

    def __init__(self) -> None:
        self.uploads: list[dict] = []

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, **kwargs):
        self.uploads.append(kwargs)


class StandInEngine:
    """Takes the place of :class:`~trl_sae.generation.vllm_backend.VLLMRollout` where vLLM is not needed:
    samples with the Transformers path, returns the sampled tokens' log-probs as vLLM would."""

    def __init__(self, model, accelerator, tokenizer, **settings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.synced = 0

    def sync_weights(self):
        self.synced += 1

    def generate(self, prompt_ids, prompt_mask, num_generations, seed):
        from trl_sae.generation import generate_with_logprobs, pure_sampling_config
        from trl_sae.generation.vllm_backend import VLLMRolloutOutput

        config = pure_sampling_config(
            self.settings["temperature"],
            self.settings["max_completion_length"],
            self.settings["stop_token_ids"],
            self.tokenizer.pad_token_id,
        )
        out = generate_with_logprobs(self.model, prompt_ids, prompt_mask, config)
        return VLLMRolloutOutput(out.completion_ids, out.completion_mask, out.logprobs, out.is_truncated)

    def close(self):
        pass


def run_recorded(tmp_path, tokenizer, reads: set[str], peft: bool = False, **overrides) -> SAEPPOTrainer:
    """Build, train 2 steps, evaluate and save under ``overrides``, recording the fields read."""
    # The variants share tmp_path: each fresh run replaces the previous one's checkpoints.
    overrides.setdefault("overwrite_output_dir", True)
    config = make_config(tmp_path, max_steps=2, response_length=4, **overrides)
    record_reads(config, reads)
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=config,
        train_dataset=make_dataset(n=4),
        eval_dataset=make_dataset(n=2) if config.eval_strategy != "no" else None,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0) if peft else None,
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    return trainer


def test_every_config_field_is_honoured_or_rejected(tmp_path, tokenizer, monkeypatch):
    fields = [f.name for f in dataclasses.fields(SAEPPOConfig)]
    assert set(REJECTED_VALUES) == set(UNSUPPORTED_FIELDS), "give each rejected field a value to test"

    # 0. What an argument parser produces when nothing is set is accepted (it spells some defaults differently).
    HfArgumentParser(SAEPPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true"]
    )

    # 1. Rejected: a non-default value is an error that names the field.
    for name, value in REJECTED_VALUES.items():
        with pytest.raises(ValueError, match=rf"SAEPPOConfig\.{name}="):
            make_config(tmp_path, **{name: value})

    # 2. Honoured while the config is built, or by the reporting integrations: checked in their sources.
    post_init = inspect.getsource(TrainingArguments.__post_init__)
    setup_devices = inspect.getsource(TrainingArguments._setup_devices.func)
    assert make_config(tmp_path, activation_checkpointing=True).gradient_checkpointing is True
    kwargs = {"use_reentrant": True}
    assert (
        make_config(tmp_path, activation_checkpointing_kwargs=kwargs).gradient_checkpointing_kwargs == kwargs
    )
    assert "self.tf32" in post_init and "self.device" in post_init
    assert "self.ddp_backend" in setup_devices and "self.ddp_timeout" in setup_devices
    import transformers.integrations.integration_utils as integrations

    source = inspect.getsource(integrations)
    assert all(f"args.{name}" in source for name in HONOURED_BY_REPORTING_INTEGRATIONS)

    # 3. Everything else must be read by the trainer (built, trained, evaluated, saved) in some variant.
    import transformers.trainer

    hub = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    reads: set[str] = set()
    run_recorded(
        tmp_path,
        tokenizer,
        reads,
        eval_strategy="steps",
        eval_steps=1,
        eval_on_start=True,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        kl_coef=0.1,
        whiten_rewards=True,
        segmentation="uniform",
        segment_length=2,
        log_completions=True,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        push_to_hub=True,
        hub_model_id="me/model",
        hub_revision="main",
    )
    assert hub.uploads and hub.uploads[-1]["revision"] == "main"
    run_recorded(
        tmp_path,
        tokenizer,
        reads,
        peft=True,
        segmentation="entropy",
        merge_adapters=True,
        # value pretraining's fields are read only while it runs (value_pretrain_path: tests/test_value_pretrain.py)
        value_pretrain_rollouts=8,
        value_pretrain_held_out=8,
        value_pretrain_epochs=1,
        value_pretrain_learning_rate=1e-2,
    )
    try:
        run_recorded(
            tmp_path,
            tokenizer,
            reads,
            full_determinism=True,
            max_grad_norm=None,
            max_prompt_length=3,  # every prompt is longer, so the over-long policy is read
            overlong_prompts="truncate",
            # the RLVR knobs whose fields are read only when their knob is on
            overlong_buffer_length=2,
            overlong_penalty_factor=0.5,
            positive_nll_coef=0.1,
            positive_nll_threshold=0.1,
        )
    finally:
        torch.use_deterministic_algorithms(False)  # full_determinism switches it on for the whole process

    # vLLM: the engine is tests/test_vllm.py's business (it needs vLLM installed); here a stand-in engine that
    # samples with Transformers shows the trainer reads every vllm_* field when it builds and uses one.
    monkeypatch.setattr("trl_sae.trainer.setup.vllm.is_vllm_available", lambda: True)
    monkeypatch.setattr("trl_sae.trainer.setup.vllm.VLLMRollout", StandInEngine)
    # ... with dynamic sampling on (filter_groups, max_num_gen_batches), so a filtered step runs the vLLM path.
    run_recorded(
        tmp_path,
        tokenizer,
        reads,
        use_vllm=True,
        vllm_importance_sampling_mode="token_truncate",
        filter_groups=True,
        max_num_gen_batches=2,
    )

    outside = set(HONOURED_WHILE_THE_CONFIG_IS_BUILT) | HONOURED_BY_REPORTING_INTEGRATIONS
    unaccounted = [name for name in fields if name not in UNSUPPORTED_FIELDS and name not in outside]
    never_read = sorted(set(unaccounted) - reads)
    assert not never_read, (
        f"SAEPPOConfig fields neither rejected (config.UNSUPPORTED_FIELDS) nor read by the trainer: {never_read}. "
        "Honour each (and add a variant here that reads it) or reject it with a reason."
    )


# ------------------------------------------------------------------------------------------------
# The walk over numbers: 0 and -1 in every numeric field are either rejected in one line or meaningful
# ------------------------------------------------------------------------------------------------
# (field, value) pairs that are valid settings, with what they mean. Every other 0 or -1 must be an error.
MEANINGFUL_ZERO_OR_NEGATIVE: dict[tuple[str, int], str] = {
    ("max_steps", 0): "<= 0 trains for num_train_epochs, as in transformers",
    ("max_steps", -1): "<= 0 trains for num_train_epochs, as in transformers (the default)",
    ("max_grad_norm", 0): "<= 0 does not clip, as in transformers",
    ("max_grad_norm", -1): "<= 0 does not clip, as in transformers",
    ("learning_rate", 0): "a frozen actor",
    ("critic_learning_rate", 0): "a frozen critic",
    ("value_head_trunk_grad_scale", 0): "the head critic's value loss does not reach the trunk (the default)",
    ("value_head_layer", 0): "the head critic reads decoder layer 0's output",
    ("value_head_layer", -1): "the head critic reads the last decoder layer's output (Python's indexing)",
    ("warmup_steps", 0): "no learning-rate warm-up",
    ("value_warmup_steps", 0): "no critic-only steps",
    ("value_pretrain_rollouts", 0): "no value pretraining (the default)",
    ("value_pretrain_held_out", 0): "the default, with value_pretrain_rollouts=0 (no value pretraining)",
    ("value_pretrain_min_delta", 0): "any rise of held-out explained variance counts (the default)",
    ("eval_delay", 0): "evaluate from the start",
    ("weight_decay", 0): "no weight decay",
    ("adam_beta1", 0): "Adam without momentum",
    ("adam_beta2", 0): "Adam without a second-moment average",
    ("adam_epsilon", 0): "no epsilon in Adam's denominator",
    ("kl_coef", 0): "no KL penalty (the paper's setting)",
    ("entropy_coef", 0): "no entropy bonus (the paper's setting)",
    ("vf_coef", 0): "no value loss",
    ("gamma", 0): "no discounting beyond one step",
    ("lam", 0): "one-step TD advantages",
    ("critic_lam", 0): "one-step TD critic targets",
    ("seed", 0): "a seed",
    ("data_seed", 0): "a seed",
    ("stop_token_id", 0): "a token id",
    ("missing_eos_penalty", 0): "no penalty",
    ("overlong_buffer_length", 0): "no overlong penalty (the default)",
    ("positive_nll_coef", 0): "no positive-example NLL loss (the default)",
    ("positive_nll_threshold", 0): "completions with a positive reward count as positive (the default)",
    ("num_completions_to_print", 0): "log the table without printing rows",
    ("eval_temperature", 0): "greedy evaluation",
    ("vllm_importance_sampling_clip_min", 0): "no lower bound in effect",
}
# vLLM fields are checked where they apply: with use_vllm, in the mode that reads them.
_SERVER_ONLY = {"vllm_server_port", "vllm_server_timeout", "vllm_group_port"}


def _numeric_fields() -> list[str]:
    names = []
    for f in dataclasses.fields(SAEPPOConfig):
        kind = str(f.type)
        if f.name in UNSUPPORTED_FIELDS or "bool" in kind:
            continue
        if "int" in kind or "float" in kind:
            names.append(f.name)
    return names


def test_zero_and_negative_counts_are_rejected_naming_the_field(tmp_path):
    names = _numeric_fields()
    # The ones a new user hit (issue 25), and the counts the PPO loop divides or loops by.
    assert {
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_mini_batches",
        "num_ppo_epochs",
        "num_generations",
        "local_rollout_forward_batch_size",
        "per_device_eval_batch_size",
        "response_length",
    } <= set(names)
    accepted = []
    for name in names:
        extra = {}
        if name.startswith("vllm_"):
            extra = {"use_vllm": True, "vllm_mode": "server" if name in _SERVER_ONLY else "colocate"}
        for value in (0, -1):
            if (name, value) in MEANINGFUL_ZERO_OR_NEGATIVE:
                make_config(tmp_path, **extra, **{name: value})  # accepted
                continue
            try:
                make_config(tmp_path, **extra, **{name: value})
            except ValueError as error:
                message = str(error)
                assert message.startswith(f"SAEPPOConfig.{name}"), message
                assert "\n" not in message, message
            else:
                accepted.append(f"{name}={value}")
    assert not accepted, f"accepted without a meaning listed in MEANINGFUL_ZERO_OR_NEGATIVE: {accepted}"


def test_a_batch_size_of_zero_fails_in_the_config_not_in_the_trainer(tmp_path):
    with pytest.raises(ValueError) as error:
        make_config(tmp_path, per_device_train_batch_size=0)
    assert str(error.value) == (
        "SAEPPOConfig.per_device_train_batch_size: must be >= 1, got 0 (completions per micro-batch on each "
        "process)."
    )
