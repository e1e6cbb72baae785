"""What :class:`~trl_sae.SAEPPOConfig` does with the fields it inherits from TRL's ``PPOConfig`` and
transformers' ``TrainingArguments``: the ones the trainer has no use for (:data:`UNSUPPORTED_FIELDS`, an
error when set), the ranges of counts and coefficients (:data:`MINIMUMS`), and the process-group backend
DeepSpeed needs on CPU (:func:`deepspeed_cpu_backend`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

__all__ = [
    "MINIMUMS",
    "UNSUPPORTED_FIELDS",
    "InheritedFieldChecks",
    "deepspeed_cpu_backend",
    "field_default",
    "is_default",
    "non_finite",
]

_NO_DATALOADER = "SAEPPOTrainer indexes prompts itself (a seeded shuffle per epoch) and builds no DataLoader"
_NO_EVAL_LOOP = (
    "SAEPPOTrainer.evaluate() samples and scores completions of the eval prompts; it has no prediction loop"
)
_USE_ACCELERATE = (
    "SAEPPOTrainer builds its Accelerator from the `accelerate launch` environment; pass this through "
    "`accelerate launch --config_file` (see examples/accelerate_configs/)"
)
_DERIVED = (
    "the trainer computes it from per_device_train_batch_size, gradient_accumulation_steps and the number "
    "of processes (and overwrites it); set those instead"
)

# lr_scheduler_type values whose scheduler steps on a metric (transformers' "greedy" is GreedyLR).
METRIC_SCHEDULERS = frozenset({"reduce_lr_on_plateau", "greedy"})

# Inherited TrainingArguments / PPOConfig fields that SAEPPOTrainer does not use: a non-default value is an
# error naming the field, never a silently ignored setting. Every field NOT listed here must be honoured;
# tests/test_settings.py walks every field of SAEPPOConfig (new ones included) and checks each is either
# listed here or read by the trainer when set. Add a field here only with the reason and the alternative.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "accelerator_config": _USE_ACCELERATE,
    "auto_find_batch_size": "set per_device_train_batch_size and gradient_accumulation_steps yourself",
    "average_tokens_across_devices": "the PPO losses are token means per micro-batch on each process",
    "batch_eval_metrics": _NO_EVAL_LOOP,
    "bf16_full_eval": "evaluation samples with the training model in its training precision",
    "fp16_full_eval": "evaluation samples with the training model in its training precision",
    "dataloader_drop_last": _NO_DATALOADER,
    "dataloader_in_order": _NO_DATALOADER,
    "dataloader_multiprocessing_context": _NO_DATALOADER,
    "dataloader_num_workers": _NO_DATALOADER,
    "dataloader_persistent_workers": _NO_DATALOADER,
    "dataloader_pin_memory": _NO_DATALOADER,
    "dataloader_prefetch_factor": _NO_DATALOADER,
    "train_sampling_strategy": _NO_DATALOADER,
    "length_column_name": _NO_DATALOADER,
    "remove_unused_columns": "every dataset column other than the prompt always reaches the reward functions",
    "label_names": "PPO trains on sampled completions, not labels",
    "label_smoothing_factor": "PPO trains on sampled completions, not labels",
    "prediction_loss_only": _NO_EVAL_LOOP,
    "eval_accumulation_steps": _NO_EVAL_LOOP,
    "eval_do_concat_batches": _NO_EVAL_LOOP,
    "eval_use_gather_object": _NO_EVAL_LOOP,
    "include_for_metrics": _NO_EVAL_LOOP,
    "load_best_model_at_end": "checkpoints are not ranked by a metric; pick one by its logged eval/reward/mean",
    "metric_for_best_model": "checkpoints are not ranked by a metric; pick one by its logged eval/reward/mean",
    "greater_is_better": "checkpoints are not ranked by a metric; pick one by its logged eval/reward/mean",
    "debug": "the debug options hook Trainer's own training loop",
    "deepspeed": _USE_ACCELERATE,
    "fsdp": _USE_ACCELERATE,
    "fsdp_config": _USE_ACCELERATE,
    "parallelism_config": _USE_ACCELERATE,
    "do_train": "it is only a flag for scripts; train() always trains",
    "do_eval": "set eval_strategy (and pass eval_dataset) to evaluate during training",
    "do_predict": "SAEPPOTrainer has no predict()",
    "enable_jit_checkpoint": "save checkpoints with save_strategy / save_steps",
    "hub_strategy": "checkpoints are not pushed; push the final model with trl_sae.hub.save_and_push",
    "hub_always_push": "checkpoints are not pushed; push the final model with trl_sae.hub.save_and_push",
    "ignore_data_skip": "resuming needs no data skipping: each step's prompts are a function of the step",
    "restore_callback_states_from_checkpoint": "resuming restores the trainer state, not callback states",
    "save_only_model": "checkpoints always hold optimizer, scheduler and RNG state so a run resumes exactly; "
    "use trainer.save_model() for weights only",
    "include_num_input_tokens_seen": "the PPO loop does not count input tokens",
    "logging_nan_inf_filter": "non-finite losses are not filtered out of the logs",
    "neftune_noise_alpha": "NEFTune is a supervised fine-tuning method",
    "optim_target_modules": "GaLore / APOLLO optimizers need Trainer's own parameter grouping",
    "skip_memory_metrics": "the PPO loop does not track memory metrics",
    "torch_compile": "the PPO loop does not compile the model",
    "torch_compile_backend": "the PPO loop does not compile the model",
    "torch_compile_mode": "the PPO loop does not compile the model",
    "torch_empty_cache_steps": "the PPO loop does not empty the device cache on a schedule",
    "use_cache": "generation always uses the KV cache and the training forward never does",
    "use_liger_kernel": "the PPO loss computes its own chunked log-softmax",
    "liger_kernel_config": "the PPO loss computes its own chunked log-softmax",
    "num_sample_generations": "use log_completions=True (sampled training completions every logging step) "
    "and eval_strategy with an eval_dataset (eval/reward/mean during training)",
    "reward_model_path": "pass `reward_model` or `reward_funcs` to the trainer",
    "sft_model_path": "pass `model` to the trainer",
    "local_rank": "the process's rank comes from the launcher's environment (LOCAL_RANK); use `accelerate "
    "launch` or torchrun",
    "world_size": _DERIVED,
    "num_total_batches": "set max_steps, num_train_epochs or total_episodes instead",
    "micro_batch_size": _DERIVED,
    "local_batch_size": _DERIVED,
    "batch_size": _DERIVED,
    "local_mini_batch_size": _DERIVED,
    "mini_batch_size": _DERIVED,
}


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# Spellings TrainingArguments treats as the same value (argument parsers produce the bool form).
SAME_VALUE = {"include_num_input_tokens_seen": {False: "no", True: "all"}}


def is_default(name: str, value: Any, default: Any) -> bool:
    if isinstance(value, bool) and name in SAME_VALUE:
        value = SAME_VALUE[name][value]
    # Empty values are interchangeable (`debug=""` vs `[]`, `include_for_metrics=[]` vs `None`).
    empty = (None, "", [], (), {})
    return value == default or (value in empty and default in empty)


def non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(non_finite(v) for v in value)
    return False


# Counts, sizes, intervals and coefficients: (bound, bound excluded, what the field is). 0 or a negative value
# would otherwise fail deep in the trainer (a batch size of 0 is a ZeroDivisionError) or silently train
# nothing (0 PPO epochs), so each is one error naming the field. None passes (where a field takes None, it
# means "derive it" or "no limit"). Not listed: fields where 0 or a negative is meaningful, as in
# transformers (max_steps <= 0 trains for num_train_epochs; max_grad_norm <= 0 does not clip), and those
# _validate checks with a message of their own (num_generations, response_length, segment_length, ...).
MINIMUMS: dict[str, tuple[float, bool, str]] = {
    "per_device_train_batch_size": (1, False, "completions per micro-batch on each process"),
    "gradient_accumulation_steps": (1, False, "micro-batches per rollout batch"),
    "num_mini_batches": (1, False, "optimizer steps per PPO epoch"),
    "num_ppo_epochs": (1, False, "passes over each rollout batch"),
    "local_rollout_forward_batch_size": (1, False, "completions per forward pass over the rollouts"),
    "per_device_eval_batch_size": (1, False, "eval prompts sampled at once on each process"),
    "total_episodes": (1, False, "completions to train on; None derives it from num_train_epochs"),
    "num_train_epochs": (0, True, "passes over the train dataset when max_steps <= 0"),
    "logging_steps": (0, True, "steps between logs; below 1, a fraction of the run"),
    "save_steps": (0, True, "steps between checkpoints; below 1, a fraction of the run"),
    "eval_steps": (0, True, "steps between evaluations; below 1, a fraction of the run"),
    "save_total_limit": (1, False, "checkpoints kept; None keeps them all"),
    "dataset_num_proc": (1, False, "processes tokenizing the prompts; None for this one"),
    "ddp_timeout": (0, True, "seconds a collective operation may wait"),
    "ddp_bucket_cap_mb": (1, False, "DDP gradient bucket size in MB; None for PyTorch's default"),
    "warmup_steps": (0, False, "learning-rate warm-up steps; below 1, a fraction of the run"),
    "eval_delay": (0, False, "steps or epochs before the first evaluation"),
    "seed": (0, False, "the run's random seed"),
    "data_seed": (0, False, "the seed of the prompt order; None uses seed"),
    "weight_decay": (0, False, "AdamW's weight decay"),
    "adam_epsilon": (0, False, "AdamW's epsilon"),
    "cliprange": (0, True, "PPO's policy-ratio clip epsilon"),
    "cliprange_value": (0, True, "the value-loss clip epsilon"),
    "cliprange_high": (
        0,
        True,
        "the upper policy-ratio clip epsilon (DAPO's clip-higher); None uses cliprange",
    ),
    "overlong_buffer_length": (
        0,
        False,
        "tokens before response_length where the overlong penalty grows; 0 for off",
    ),
    "overlong_penalty_factor": (0, True, "the overlong penalty at response_length"),
    "positive_nll_coef": (0, False, "the weight of VAPO's positive-example NLL loss; 0 for off"),
    "vf_coef": (0, False, "the value-loss coefficient"),
    "missing_eos_penalty": (0, False, "subtracted from the score of a completion with no EOS; None for none"),
    "stop_token_id": (0, False, "a token id; None stops as stop_token says"),
    "num_completions_to_print": (0, False, "completion rows printed per log"),
}


def deepspeed_cpu_backend(use_cpu: bool) -> str | None:
    """The process-group backend for DeepSpeed processes on CPU (``DS_ACCELERATOR=cpu``), or None where
    accelerate finds one itself; ``SAEPPOConfig`` puts it in an unset ``ddp_backend``.

    accelerate picks a backend only for GPU-like devices (or ``cpu=True``, which turns DeepSpeed off); on CPU
    ranks it has none, lets DeepSpeed start gloo, then counts ONE process, so with two the first gather
    fails (``ProcessGroupGloo::allgather: invalid output tensor list``). Naming DeepSpeed's own backend
    (gloo, or ccl with oneCCL) makes accelerate read the world size from the process group. It must be
    known when the config is built: ``TrainingArguments`` starts accelerate's process state there, with
    ``ddp_backend``, and the Accelerator reuses it.
    """
    launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
    if use_cpu or not launched or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.communication_backend_name() if accelerator.device_name() == "cpu" else None


class InheritedFieldChecks:
    """The checks :class:`~trl_sae.SAEPPOConfig` runs on the values as given, before ``TrainingArguments``
    normalises them (and may fail less clearly)."""

    def _reject_unsupported_fields(self) -> None:
        """Reject non-default values of :data:`UNSUPPORTED_FIELDS` and nan / inf in any float field."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if non_finite(value):
                raise ValueError(
                    f"SAEPPOConfig.{f.name}: must be finite, got {value!r}; no setting takes nan or inf."
                )
            reason = UNSUPPORTED_FIELDS.get(f.name)
            if reason is not None and not is_default(f.name, value, field_default(f)):
                raise ValueError(
                    f"SAEPPOConfig.{f.name}={value!r} is not supported by SAEPPOTrainer and would be ignored: "
                    f"{reason}. Leave it at its default ({field_default(f)!r})."
                )
        if self.save_strategy == "best":
            raise ValueError(
                "SAEPPOConfig.save_strategy='best' is not supported: checkpoints are not ranked by a metric. "
                "Use save_strategy='steps' or 'epoch' and pick a checkpoint by its logged eval/reward/mean."
            )
        # These schedulers step on a metric (Trainer steps them after each evaluation); the PPO update steps
        # its scheduler once per update without one, so the run would die with a TypeError after update 1.
        scheduler = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        if scheduler in METRIC_SCHEDULERS:
            raise ValueError(
                f"SAEPPOConfig.lr_scheduler_type={scheduler!r} is not supported: it steps on an evaluation "
                "metric and SAEPPOTrainer steps its scheduler once per PPO update without one. Use 'linear', "
                "'cosine', 'cosine_with_min_lr', 'constant', 'constant_with_warmup' or another step-based schedule."
            )

    def _reject_out_of_range_counts(self) -> None:
        """Reject counts, sizes and coefficients outside their range (:data:`MINIMUMS`, Adam's betas)."""
        for name, (bound, excluded, meaning) in MINIMUMS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"SAEPPOConfig.{name}: must be a number, got {value!r} ({meaning}).")
            if value < bound or (excluded and value == bound):
                raise ValueError(
                    f"SAEPPOConfig.{name}: must be {'>' if excluded else '>='} {bound}, got {value!r} ({meaning})."
                )
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(
                    f"SAEPPOConfig.{name}: must be in [0, 1), got {value!r} (an Adam decay rate)."
                )
