"""Configuration of :class:`~trl_sae.SAEPPOTrainer`: TRL's ``PPOConfig`` plus the SAE fields.

Defaults follow the SAE paper (Section 5.1): 8 samples per prompt, actor lr 1e-6, critic lr 1e-5,
p = 0.2, no KL penalty and no entropy bonus, critic targets from GAE(lambda = 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.ppo import PPOConfig

from .advantages import ADVANTAGE_ESTIMATORS

__all__ = ["SEGMENTATIONS", "SAEPPOConfig"]

SEGMENTATIONS = ("probability", "uniform", "newline", "entropy")


@dataclass
class SAEPPOConfig(PPOConfig):
    r"""Configuration for :class:`~trl_sae.SAEPPOTrainer`.

    Everything :class:`trl.experimental.ppo.PPOConfig` (and ``transformers.TrainingArguments``) accepts is
    accepted with the same name and meaning; ``per_device_train_batch_size`` counts *completions*
    (prompts x ``num_generations``), as in TRL. The fields below are new or have SAE-paper defaults.

    Parameters:
        advantage_estimator (`str`, defaults to `"sae"`):
            One of `"sae"`, `"gae"`, `"mc"` (lambda = 1), `"adaptive_lambda"` (VAPO) or `"grpo"` (no critic).
        segmentation (`str`, defaults to `"probability"`):
            How SAE finds segment boundaries: `"probability"` (token probability < `segment_threshold`, paper
            Eq. 5), `"uniform"` (every `segment_length` tokens), `"newline"` (tokens containing a newline) or
            `"entropy"` (policy entropy > `entropy_threshold`).
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
        critic_learning_rate (`float`, defaults to `1e-5`):
            Learning rate of the critic (the actor uses `learning_rate`).
        value_warmup_steps (`int`, defaults to `0`):
            Steps at the start of training that update only the critic (VAPO's value pretraining).
        whiten_advantages (`bool`, defaults to `True`):
            Whiten advantages over the valid tokens of the batch (not applied to GRPO, which is already
            group-normalised).
        grpo_scale (`str`, defaults to `"std"`):
            `"std"` divides GRPO's group-centred scores by the group std, `"none"` only centres (Dr. GRPO).
        entropy_coef (`float`, defaults to `0.0`):
            Entropy bonus coefficient (the paper uses none).
        reward_weights (`list[float]`, *optional*):
            Weights of the reward functions, all 1 by default.
        reward_timeout (`float`, *optional*):
            Seconds one call of one reward function may take (`None`: no limit; the recipes use 300). With a
            limit, each call runs in a daemon thread; on overrun training stops with a `RewardTimeoutError`
            naming the function, on every process. The overrunning call cannot be killed: it is abandoned,
            still running in its thread, until it returns or the process exits. Keep it below `ddp_timeout`
            in multi-process runs.
        max_prompt_length (`int`, *optional*, defaults to `512`):
            Prompts longer than this are truncated from the left.
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
        default="eos", metadata={"help": "Stop generation at the tokenizer's EOS ('eos') or never (None)."}
    )
    num_sample_generations: int = field(
        default=0, metadata={"help": "Debug sample generations on the eval set during training (0: none)."}
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
    logging_steps: float = field(default=1, metadata={"help": "Log every X steps."})

    # SAE and estimator settings.
    advantage_estimator: str = field(
        default="sae", metadata={"help": "Advantage estimator: sae, gae, mc, adaptive_lambda or grpo."}
    )
    segmentation: str = field(
        default="probability",
        metadata={"help": "Segmenter for SAE: probability, uniform, newline or entropy."},
    )
    segment_threshold: float = field(default=0.2, metadata={"help": "SAE's p: boundary where prob < p."})
    segment_length: int = field(default=200, metadata={"help": "M for uniform segmentation."})
    entropy_threshold: float = field(
        default=1.0, metadata={"help": "Nats above which a token opens a segment."}
    )
    critic_lam: float = field(default=1.0, metadata={"help": "Lambda of the critic's GAE returns."})
    adaptive_lambda_alpha: float = field(default=0.2, metadata={"help": "VAPO alpha for adaptive_lambda."})
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt."})
    critic_learning_rate: float = field(default=1e-5, metadata={"help": "Critic learning rate."})
    value_warmup_steps: int = field(default=0, metadata={"help": "Critic-only steps before the actor moves."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Whiten advantages (not for grpo)."})
    grpo_scale: str = field(default="std", metadata={"help": "GRPO scaling: std or none."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the reward functions."}
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one reward-function call may take before training stops (None: no limit)."
        },
    )
    max_prompt_length: int | None = field(default=512, metadata={"help": "Left-truncate longer prompts."})
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

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = (
                not self.fp16
                and torch.cuda.is_available()
                and torch.cuda.is_bf16_supported()
                and not self.use_cpu
            )
        super().__post_init__()
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, problem: str) -> None:
            raise ValueError(f"SAEPPOConfig.{name}: {problem}")

        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            fail(
                "advantage_estimator",
                f"{self.advantage_estimator!r} is unknown; choose from {sorted(ADVANTAGE_ESTIMATORS)}.",
            )
        if self.segmentation not in SEGMENTATIONS:
            fail("segmentation", f"{self.segmentation!r} is unknown; choose from {list(SEGMENTATIONS)}.")
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
        if self.advantage_estimator == "grpo" and self.num_generations < 2:
            fail("num_generations", "GRPO compares samples of the same prompt; use num_generations >= 2.")
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
        for name in ("learning_rate", "critic_learning_rate"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}.")
        for name in ("kl_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}.")
        if self.value_warmup_steps < 0:
            fail("value_warmup_steps", f"must be >= 0, got {self.value_warmup_steps}.")
        if self.value_warmup_steps > 0 and not self.uses_critic:
            fail(
                "value_warmup_steps",
                "the grpo estimator has no critic to warm up, so the actor would just sit still for "
                f"{self.value_warmup_steps} steps; set value_warmup_steps=0.",
            )
        if self.grpo_scale not in ("std", "none"):
            fail("grpo_scale", f"must be 'std' or 'none', got {self.grpo_scale!r}.")
        if self.advantage_estimator == "grpo" and self.kl_coef > 0:
            fail(
                "kl_coef",
                "the grpo estimator uses outcome scores only, so a KL token penalty would be silently ignored; "
                "set kl_coef=0 or use a critic-based estimator.",
            )
        if self.kl_estimator not in ("k1", "k3"):
            fail("kl_estimator", f"must be 'k1' or 'k3', got {self.kl_estimator!r}.")
        if self.reward_weights is not None and any(
            not isinstance(w, (int, float)) or w != w for w in self.reward_weights
        ):
            fail("reward_weights", f"must be a list of numbers, got {self.reward_weights!r}.")
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

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a learned value function (everything but GRPO)."""
        return self.advantage_estimator != "grpo"
