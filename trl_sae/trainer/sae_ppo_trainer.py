"""SAEPPOTrainer: PPO with Segmental Advantage Estimation on TRL's PPO trainer.

One training step is a pipeline of short phases, each a method a subclass can override:

    rollouts.collect -> _compute_values -> _compute_boundaries -> _compute_advantages -> ppo_update.run -> _log_step

They pass one :class:`RolloutBatch` along, each filling its fields. Changing the estimator is a config
value; changing how a phase works is one method, never a copy of the loop. The rollout part (sampling and
scoring, :class:`~trl_sae.trainer.parts.rollout.Rollouts`) is swapped whole through ``_build_rollouts``, the update
part (:class:`~trl_sae.trainer.parts.update.PPOUpdate`) through ``_build_ppo_update``.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from accelerate.utils import DistributedType, gather_object
from datasets import Dataset
from torch import nn
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainerControl,
)
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.utils import logging as hf_logging

from trl_sae._moved import moved_attribute_error, refuse_moved_overrides
from trl_sae.core.segmentation import get_segmenter_spec
from trl_sae.generation.capture import (
    fsdp2_root_unsharded,
    pure_sampling_config,
)
from trl_sae.generation.inputs import sequence_inputs
from trl_sae.generation.vllm_backend import VLLMRollout
from trl_sae.trainer.checkpoints.folders import (
    model_setup,
    parse_resume_flag,
    rotate_checkpoints,
    sorted_checkpoints,
)
from trl_sae.trainer.checkpoints.state import (
    CheckpointState,
    load_checkpoint,
    plan_start,
    save_checkpoint,
    save_model_files,
    save_peft_policy,
)
from trl_sae.trainer.config import SAEPPOConfig
from trl_sae.trainer.critics.build import (
    check_model_arguments,
    load_critic,
    uses_head_critic,
    uses_shared_critic,
    wrap_policy_and_critic,
)
from trl_sae.trainer.critics.policy_and_critic import SharedBaseCritic, critic_values
from trl_sae.trainer.objectives.advantages import compute_advantages
from trl_sae.trainer.parts.evaluation import evaluate_policy
from trl_sae.trainer.parts.metrics import (
    LATEST_VALUE_METRICS,
    average_logs,
    completion_rows,
    log_completions_to_wandb,
    print_completions_table,
    rlvr_knob_metrics,
    step_metrics,
)
from trl_sae.trainer.parts.rollout import Rollouts
from trl_sae.trainer.parts.update import PPOUpdate, token_budget_micro_batches
from trl_sae.trainer.parts.value_pretrain import (
    StepPhases,
    ValuePretraining,
    check_value_pretrain_setup,
    continues_value_pretraining,
    prepare_critic,
)
from trl_sae.trainer.rollout_batch import RolloutBatch
from trl_sae.trainer.setup.adapters import reference_adapter
from trl_sae.trainer.setup.callbacks import set_step_intervals, trainer_callbacks
from trl_sae.trainer.setup.distributed import (
    build_accelerator,
    check_deepspeed_saving,
    configure_deepspeed_batch_sizes,
    configure_deepspeed_clipping,
)
from trl_sae.trainer.setup.generation import newline_token_ids, stop_token_ids
from trl_sae.trainer.setup.models import (
    build_reference,
    check_adapter_merge,
    check_peft_config,
    disable_dropout,
    enable_gradient_checkpointing,
    load_policy,
    load_tokenizer,
    prepare_quantized_policy,
    select_adapters,
    wrap_with_peft,
)
from trl_sae.trainer.setup.optimizer import optimizer_param_groups
from trl_sae.trainer.setup.prompts import (
    check_evaluation_setup,
    derive_batch_sizes,
    handle_overlong_prompts,
    tokenize_prompt_dataset,
)
from trl_sae.trainer.setup.rewards import resolve_rewards
from trl_sae.trainer.setup.vllm import build_vllm_rollout, check_vllm_setup, longest_prompt_length
from trl_sae.trainer.trl_base import SAE_PAPER, OnlineTrainerState, PPOTrainer

__all__ = ["SAEPPOTrainer", "token_budget_micro_batches"]

logger = hf_logging.get_logger(__name__)


class SAEPPOTrainer(PPOTrainer):
    """PPO with SAE (or GAE / Monte-Carlo / VAPO's adaptive lambda / GRPO) from verifiable rewards.

    Args:
        model: the policy, a ``PreTrainedModel`` or a Hub id / local path (loaded with
            ``args.model_init_kwargs``).
        reward_funcs: one callable or a list, ``f(prompts, completions, completion_ids, **columns) ->
            list[float | None]``; summed with ``args.reward_weights``.
        args: an :class:`~trl_sae.SAEPPOConfig`.
        train_dataset: a ``prompt`` column (text or chat messages) or tokenised ``input_ids``; other
            columns (e.g. ``answer``) reach the reward functions.
        processing_class: the tokenizer (loaded from ``model`` when it is a path and this is None).
        value_model: ``None`` builds a critic from the policy's weights (with a ``peft_config``: the shared-base
            critic, as ``"shared"``); a model or path is used as given; ``"head"``: a value head on the
            policy's own forward (:class:`~trl_sae.trainer.critics.head.HeadCritic`).
        peft_config: a ``peft.PeftConfig`` putting an adapter on the policy (the reference policy is then
            the base with the adapter disabled).
        eval_dataset: prompts for :meth:`evaluate`.
        reward_model: a sequence classifier scoring completions, as in TRL (added to ``reward_funcs``).
        ref_model: reference policy for the KL penalty (only used when ``args.kl_coef > 0``).
        callbacks, optimizers: as in ``transformers.Trainer``.
    """

    _tag_names: ClassVar[list[str]] = ["trl", "ppo", "sae", "trl-sae"]
    # A shared-base critic's rollout keeps its unadapted layers' output for the step's rows up to this size.
    ROLLOUT_PREFIX_BYTES: ClassVar[int] = 1 << 30
    _name = "SAE-PPO"
    _paper: ClassVar[dict[str, Any]] = SAE_PAPER  # what TRL's model card cites

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # An override of a method that moved into a part (Rollouts, PPOUpdate) would never be called: refused
        # here, naming the new place (trl_sae/_moved.py holds the table).
        super().__init_subclass__(**kwargs)
        refuse_moved_overrides(cls, SAEPPOTrainer)

    def __getattr__(self, name: str) -> Any:
        # Only reached for a missing attribute: a call of a moved method names where it is now.
        raise moved_attribute_error(self, name)

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any = None,
        args: SAEPPOConfig | None = None,
        train_dataset: Dataset | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        value_model: str | PreTrainedModel | None = None,
        peft_config: Any = None,
        eval_dataset: Dataset | None = None,
        reward_model: PreTrainedModel | None = None,
        ref_model: PreTrainedModel | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
    ) -> None:
        # TRL 1.12's PPOTrainer.__init__ is one block that always builds a reference copy and a reward model;
        # we set up the same attributes in phases instead, so reward functions, kl_coef=0 and GRPO need no
        # extra models, and reuse TRL's trainer base (its model card) unchanged. On TRL 1.13+ the base is
        # trl_base.PPOBaseTrainer, which this __init__ equally never calls.
        if args is None:
            args = SAEPPOConfig(output_dir="trl-sae-output")
        if not isinstance(args, SAEPPOConfig):
            raise TypeError(f"`args` must be an SAEPPOConfig, got {type(args).__name__}.")
        self.args = args
        self._setup_accelerator()
        # What the tokenizer, the datasets and the settings alone decide is checked before any weight loads
        # (a GGUF model took 7.5 minutes to load before its chat-template error).
        self.processing_class = self._load_tokenizer(processing_class, model)
        self._setup_rewards(reward_funcs, reward_model)
        self.train_dataset = self._prepare_prompt_dataset(train_dataset, "train_dataset")
        self.eval_dataset = (
            self._prepare_prompt_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        )
        self.train_dataset_len = len(self.train_dataset)
        self._check_evaluation_setup()
        self._setup_batch_sizes()
        check_model_arguments(args, value_model, peft_config)
        check_peft_config(peft_config, args, ref_model)
        policy = self._load_policy(model)
        self._setup_models(policy, value_model, peft_config, ref_model)
        self._setup_generation()
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = None
        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)
        self._setup_callbacks(callbacks)
        self._pending_logs: dict[str, list[float]] = defaultdict(list)  # step metrics not yet logged
        self._table_batch: RolloutBatch | None = None
        self._setup_deepspeed_clipping()
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self._setup_prefix_sharing()
        self.accelerator.register_for_checkpointing(self.lr_scheduler)
        self.model_wrapped = self.model
        self.ppo_update = self._build_ppo_update()
        self._setup_vllm()
        if self.ref_model is not None:
            self.ref_model = self.ref_model.to(self.accelerator.device)
        if self.reward_model is not None:
            self.reward_model = self.reward_model.to(self.accelerator.device)
        self.rollouts = self._build_rollouts()
        check_value_pretrain_setup(self)

    # ------------------------------------------------------------------------------------------------
    # Set-up phases
    # ------------------------------------------------------------------------------------------------
    def _setup_prefix_sharing(self) -> None:
        # FSDP2 and ZeRO gather and free weights layer by layer around each layer's call; a shared-base critic
        # keeps every layer's own pass there rather than replaying the unadapted ones.
        unwrapped = self.accelerator.unwrap_model(self.model)
        if isinstance(unwrapped, SharedBaseCritic) and self.accelerator.distributed_type in (
            DistributedType.FSDP,
            DistributedType.DEEPSPEED,
        ):
            unwrapped.share_prefix = False

    def _shared_prefix(self) -> Any:
        """Inside, a shared-base critic's passes over the step's rows (the teacher-forced recompute, value and
        reference passes) compute the layers no adapter touches once, keeping their output up to
        ``ROLLOUT_PREFIX_BYTES`` (see ``SharedBaseCritic.shared_prefix``)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if not isinstance(unwrapped, SharedBaseCritic):
            return nullcontext()
        args = self.args
        chunks = math.ceil(args.local_batch_size / args.local_rollout_forward_batch_size)
        return unwrapped.shared_prefix(chunks, max_bytes=self.ROLLOUT_PREFIX_BYTES)

    def _setup_accelerator(self) -> None:
        self.accelerator = build_accelerator(self.args)
        self.args.world_size = self.accelerator.num_processes
        self.is_deepspeed_enabled = getattr(self.accelerator.state, "deepspeed_plugin", None) is not None
        self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None
        self._setup_deepspeed_batch_sizes()  # here, so a DeepSpeed conflict fails before models load
        check_deepspeed_saving(self.accelerator)

    def _setup_deepspeed_clipping(self) -> None:
        """Make DeepSpeed clip at ``max_grad_norm`` (see :func:`~trl_sae.trainer.setup.distributed.deepspeed_gradient_clipping`)."""
        configure_deepspeed_clipping(self.accelerator, self.args.max_grad_norm)

    def _setup_deepspeed_batch_sizes(self) -> None:
        """Fill DeepSpeed's batch sizes: no dataloader is prepared to infer them from (see
        :func:`~trl_sae.trainer.setup.distributed.deepspeed_batch_sizes`)."""
        configure_deepspeed_batch_sizes(self.accelerator, self.args)

    def _check_evaluation_setup(self) -> None:
        check_evaluation_setup(self.args, self.eval_dataset)

    def _load_policy(self, model: str | PreTrainedModel) -> PreTrainedModel:
        return load_policy(model, self.args)

    def _load_tokenizer(
        self, processing_class: PreTrainedTokenizerBase | None, model: str | PreTrainedModel
    ) -> PreTrainedTokenizerBase:
        return load_tokenizer(processing_class, model, self.args)

    def _setup_rewards(self, reward_funcs: Any, reward_model: PreTrainedModel | None) -> None:
        rewards = resolve_rewards(self.args, reward_funcs, reward_model)
        self.reward_funcs, self.reward_func_names, self.reward_weights = (
            rewards.funcs,
            rewards.names,
            rewards.weights,
        )
        self.reward_model, self._reward_model_weight = reward_model, rewards.model_weight
        if reward_model is not None:
            disable_dropout(reward_model)

    def _prepare_prompt_dataset(self, dataset: Dataset | None, name: str) -> Dataset:
        """Tokenise prompts into ``input_ids`` (chat template for message lists), keeping other columns."""
        dataset = tokenize_prompt_dataset(dataset, name, self.processing_class, self.args.dataset_num_proc)
        return self._handle_overlong_prompts(dataset, name)

    def _handle_overlong_prompts(self, dataset: Dataset, name: str) -> Dataset:
        """Apply ``args.overlong_prompts`` to the tokenised prompts longer than ``args.max_prompt_length``."""
        return handle_overlong_prompts(
            dataset, name, self.args, tokenizer=self.processing_class, warn=self.accelerator.is_main_process
        )

    def _setup_models(
        self,
        policy: PreTrainedModel,
        value_model: str | PreTrainedModel | None,
        peft_config: Any,
        ref_model: PreTrainedModel | None,
    ) -> None:
        """Policy (+ adapter), critic, reference, and the one module the update runs through
        (construction in :mod:`trl_sae.trainer.setup.models`)."""
        args = self.args  # (its arguments were checked by check_model_arguments / check_peft_config)
        policy = prepare_quantized_policy(policy, peft_config, args)
        # The critic is built before the adapter exists, so it starts from the plain base weights.
        shared = uses_shared_critic(args, value_model, peft_config)
        head = uses_head_critic(args, value_model)
        separate = args.uses_critic and not (shared or head)
        critic = self._build_critic(value_model, policy) if separate else None
        policy = self._wrap_with_peft(policy, peft_config)
        self.policy_model = policy
        self.is_peft_model = hasattr(policy, "peft_config") and hasattr(policy, "disable_adapter")
        self._setup_adapter_names(policy)
        check_adapter_merge(policy, args, self.is_peft_model)
        self.value_model = critic
        self.ref_model = self._build_reference(ref_model, policy)
        for module in (policy, critic, self.ref_model, self.reward_model):
            if module is not None:
                disable_dropout(module)
        self.model = self._wrap_policy_and_critic(
            policy, critic, peft_config if shared else None, head_critic=head
        )
        if shared or head:
            self.value_model = self.model  # the critic lives inside the wrapper
        if args.gradient_checkpointing:
            enable_gradient_checkpointing(self.model, policy, args, self.is_peft_model)

    def _wrap_with_peft(self, policy: PreTrainedModel, peft_config: Any) -> nn.Module:
        return wrap_with_peft(policy, peft_config, adapter_name=self.args.model_adapter_name or "default")

    def _setup_adapter_names(self, policy: nn.Module) -> None:
        """The trained adapter (``model_adapter_name``) and, optionally, a frozen reference adapter
        (``ref_adapter_name``; see :func:`~trl_sae.trainer.setup.models.select_adapters`)."""
        self.model_adapter_name = self.args.model_adapter_name
        self.ref_adapter_name = self.args.ref_adapter_name
        select_adapters(policy, self.args, self.is_peft_model)

    def _build_critic(self, value_model: str | PreTrainedModel | None, policy: nn.Module) -> nn.Module:
        return load_critic(value_model, policy, self.args.model_init_kwargs)

    def _build_reference(self, ref_model: PreTrainedModel | None, policy: nn.Module) -> nn.Module | None:
        return build_reference(ref_model, policy, self.args, self.is_peft_model)

    def _wrap_policy_and_critic(
        self,
        policy: nn.Module,
        critic: nn.Module | None,
        shared_critic_config: Any = None,
        head_critic: bool = False,
    ) -> nn.Module:
        adapter = self.args.model_adapter_name or "default"
        return wrap_policy_and_critic(
            policy,
            critic,
            shared_critic_config,
            policy_adapter=adapter,
            logprob_chunk_size=self.args.logprob_chunk_size,
            head_critic_grad_scale=self.args.value_head_trunk_grad_scale if head_critic else None,
            head_critic_layer=self.args.value_head_layer,
        )

    def _setup_batch_sizes(self) -> None:
        """Derive the batch sizes TRL's PPOConfig names from the per-process ones (see
        :func:`~trl_sae.trainer.setup.prompts.derive_batch_sizes`)."""
        self.local_prompts_per_step, self.global_prompts_per_step = derive_batch_sizes(
            self.args, self.train_dataset_len
        )
        self.local_seed = self.args.seed + self.accelerator.process_index * 100003

    def _setup_generation(self) -> None:
        """The stop tokens, the sampling ``GenerationConfig`` and, for a segmenter that reads them, the
        newline tokens (see :mod:`trl_sae.trainer.setup.generation`)."""
        args, tokenizer = self.args, self.processing_class
        base = self.policy_model.get_base_model() if self.is_peft_model else self.policy_model
        self.stop_token_ids = stop_token_ids(args, base, tokenizer)
        self.stop_token_id = self.stop_token_ids[0] if self.stop_token_ids else None  # TRL's attribute
        self.generation_config = pure_sampling_config(
            args.temperature, args.response_length, self.stop_token_ids, tokenizer.pad_token_id
        )
        if "newline_token_ids" in get_segmenter_spec(args.segmentation).reads:
            self.newline_token_ids = newline_token_ids(tokenizer, args.segmentation)

    def _setup_vllm(self) -> None:
        """With ``use_vllm``: check the run can use it, start the engine (weights pushed before the first
        rollout, and again after every optimizer step that moves the policy)."""
        self.vllm_rollout: VLLMRollout | None = None
        if not self.args.use_vllm:
            return
        check_vllm_setup(self.args, self.accelerator, self.is_peft_model)
        unwrapped = self.accelerator.unwrap_model(self.model)
        adapter = getattr(unwrapped, "policy_adapter", None) if self.is_peft_model else None
        if self.is_peft_model and adapter is None:
            adapter = self.args.model_adapter_name or "default"
        self.vllm_rollout = build_vllm_rollout(
            self.args,
            self.accelerator,
            unwrapped.policy,
            self.processing_class,
            self.stop_token_ids,
            adapter,
            longest_prompt_length([self.train_dataset, self.eval_dataset]),
        )

    def _build_rollouts(self, cls: type[Rollouts] = Rollouts) -> Rollouts:
        """The rollout part, ``self.rollouts`` (prompts -> scored ``RolloutBatch``; :mod:`trl_sae.trainer.parts.rollout`).

        To change how completions are sampled or scored, subclass :class:`~trl_sae.trainer.parts.rollout.Rollouts`
        and override this as ``def _build_rollouts(self, cls=MyRollouts): return super()._build_rollouts(cls)``.
        """
        return cls(
            args=self.args,
            accelerator=self.accelerator,
            model=self.model,
            processing_class=self.processing_class,
            train_dataset=self.train_dataset,
            state=self.state,
            generation_config=self.generation_config,
            stop_token_ids=self.stop_token_ids,
            local_prompts_per_step=self.local_prompts_per_step,
            global_prompts_per_step=self.global_prompts_per_step,
            reward_funcs=self.reward_funcs,
            reward_func_names=self.reward_func_names,
            reward_weights=self.reward_weights,
            reward_model=self.reward_model,
            reward_model_weight=self._reward_model_weight,
            vllm_rollout=self.vllm_rollout,
        )

    def _setup_callbacks(self, callbacks: list[TrainerCallback] | None) -> None:
        self.callbacks = trainer_callbacks(args := self.args, callbacks)
        self.callback_handler = CallbackHandler(
            self.callbacks, self.model, self.processing_class, self.optimizer, self.lr_scheduler
        )
        self.control = TrainerControl()
        stateful = [
            cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)
        ]
        self.state = OnlineTrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=stateful,
        )
        self.current_flos, self.hp_search_backend, self.hub_model_id = 0, None, None
        if args.push_to_hub:
            self.init_hf_repo()
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW (or ``args.optim``) with the actor at ``learning_rate`` and the critic at ``critic_learning_rate``."""
        if self.optimizer is not None:
            return self.optimizer
        args = self.args
        wrapper = self.model
        groups = optimizer_param_groups(wrapper, set(self.get_decay_parameter_names(wrapper)), args)
        if not groups:
            raise ValueError("No trainable parameters: the policy and critic are both frozen.")
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, wrapper)
        optimizer_kwargs.pop("lr", None)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    # ------------------------------------------------------------------------------------------------
    # Step phases
    # ------------------------------------------------------------------------------------------------
    def _sequence_inputs(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        return sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)

    @torch.no_grad()
    def _compute_values(self, batch: RolloutBatch) -> None:
        """Critic values of the state before each token and, with a KL penalty, reference log-probs.

        Values the rollout already captured (the head critic's, :mod:`~trl_sae.trainer.critics.head`) are
        kept: no value pass runs for them."""
        captured, batch.values = batch.values, torch.zeros_like(batch.logprobs)
        if self.args.uses_critic:
            values = captured
            if values is None:
                values = critic_values(
                    self.accelerator.unwrap_model(self.model),
                    batch.prompt_ids,
                    batch.prompt_mask,
                    batch.completion_ids,
                    batch.completion_mask,
                    chunk_size=self.args.local_rollout_forward_batch_size,
                    autocast=self.accelerator.autocast,  # the update's precision (the critic's old values)
                )
            batch.values = torch.where(batch.mask, values, torch.zeros((), device=batch.values.device))
        if self.args.kl_coef > 0:
            batch.ref_logprobs = self._reference_logprobs(batch)

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        unwrapped = self.accelerator.unwrap_model(self.model)
        reference = self.ref_model if self.ref_model is not None else unwrapped.policy
        context = self.null_ref_context() if self.ref_model is None else nullcontext()
        # The shared policy is called outside the wrapper's forward: gather an FSDP2 root's own weights.
        gathered = fsdp2_root_unsharded(unwrapped) if self.ref_model is None else nullcontext()
        with gathered, context:
            return self.rollouts.teacher_forced(
                reference, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
            )[0]

    def _compute_boundaries(self, batch: RolloutBatch) -> None:
        """Segment boundaries from the configured segmenter (also logged for non-SAE estimators)."""
        args = self.args
        segmenter = get_segmenter_spec(args.segmentation)
        newline_ids = None
        if "newline_token_ids" in segmenter.reads:  # built from the tokenizer in __init__ only when read
            newline_ids = torch.as_tensor(self.newline_token_ids, dtype=torch.long, device=batch.mask.device)
        batch.boundaries = segmenter(
            logprobs=batch.logprobs,
            entropies=batch.entropies,
            token_ids=batch.completion_ids,
            mask=batch.mask,
            newline_token_ids=newline_ids,
            segment_threshold=args.segment_threshold,
            segment_length=args.segment_length,
            entropy_threshold=args.entropy_threshold,
        )

    @torch.no_grad()
    def _compute_advantages(self, batch: RolloutBatch) -> None:
        """Token rewards, the actor's advantages (configured estimator) and the critic's GAE(critic_lam) returns
        (see :func:`~trl_sae.trainer.objectives.advantages.compute_advantages`)."""
        # Whitening statistics span every process's valid tokens (as verl's whole-batch whitening), so a run
        # does not change with the number of processes: one all-reduce of (sum, sum of squares, count).
        all_reduce_sum = None
        if self.accelerator.num_processes > 1:
            all_reduce_sum = partial(self.accelerator.reduce, reduction="sum")
        compute_advantages(batch, self.args, all_reduce_sum)

    def _build_ppo_update(self) -> PPOUpdate:
        """The update part (:class:`~trl_sae.trainer.parts.update.PPOUpdate`); override to return a subclass."""
        return PPOUpdate(self.accelerator, self.model, self.optimizer, self.args)

    def _log_step(self, batch: RolloutBatch, update_stats: dict[str, torch.Tensor]) -> dict[str, float]:
        """Gather the step's statistics across processes (the exact documented keys) for the next log.

        Every step is gathered; :meth:`_flush_logs` logs them on the steps ``logging_steps`` /
        ``logging_strategy`` choose, each metric averaged over the steps since the previous log.
        """
        metrics = step_metrics(self.accelerator, batch, update_stats, with_critic=self.args.uses_critic)
        metrics.update(self._rlvr_knob_metrics(batch, update_stats))
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["episode"] = self.state.episode
        for key, value in metrics.items():
            self._pending_logs[key].append(value)
        if self.args.log_completions:
            self._table_batch = batch  # the table shows the completions of the step that is logged
        return metrics

    def _rlvr_knob_metrics(
        self, batch: RolloutBatch, update_stats: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """The RLVR knobs' metrics, over every process (a collective; keys absent when their knob is off)."""
        return rlvr_knob_metrics(self.accelerator, batch, update_stats)

    # Metrics that are a position, not a per-step measurement: the log shows their latest value.
    _LATEST_VALUE_METRICS: ClassVar[frozenset[str]] = LATEST_VALUE_METRICS

    def _flush_logs(self) -> None:
        """Log the metrics gathered since the previous log (their means over those steps) and the table."""
        if not self._pending_logs:
            return
        logs = average_logs(self._pending_logs, self._LATEST_VALUE_METRICS)
        self._pending_logs.clear()
        if self._table_batch is not None:
            self._log_completions_table(self._table_batch)
            self._table_batch = None
        self.log(logs)

    def _log_completions_table(self, batch: RolloutBatch) -> None:
        """Completions with segment boundaries marked by '|', to the console (rich) and wandb if active."""
        rows = gather_object(completion_rows(batch, self.processing_class))
        self._last_completions = rows
        if self.accelerator.is_main_process:
            print_completions_table(rows, self.state.global_step, self.args.num_completions_to_print)
            log_completions_to_wandb(rows, self.args.report_to)

    # ------------------------------------------------------------------------------------------------
    # Training loop
    # ------------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step: every phase in order on the prompts of ``step``."""
        start = time.perf_counter()
        # Dynamic sampling's rounds are re-padded into one batch, whose rows no round's pass had.
        with self._shared_prefix() if not self.args.filter_groups else nullcontext():
            batch, filter_metrics = self.rollouts.collect(step)
            batch.timings["rollout"] = time.perf_counter() - start
            with self._shared_prefix():
                self._compute_values(batch)
        self._compute_boundaries(batch)
        self._compute_advantages(batch)
        start = time.perf_counter()
        update_stats = self.ppo_update.run(batch, self.state.global_step)
        if self.ppo_update.trains_actor(self.state.global_step):
            self.rollouts.mark_weights_stale()  # the next rollout pushes the new weights first
        batch.timings["update"] = time.perf_counter() - start
        self.state.episode += self.args.batch_size
        self.state.global_step += 1
        self.state.epoch = self.state.episode / (self.train_dataset_len * self.args.num_generations)
        metrics = self._log_step(batch, update_stats)
        for key, value in filter_metrics.items():  # with filter_groups: logged like every step metric
            self._pending_logs[key].append(value)
        return {**metrics, **filter_metrics}

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> None:
        """Run ``num_total_batches`` PPO steps (after value pretraining, when set), resuming if asked. Logs,
        evaluation and checkpoints follow ``logging_*``, ``eval_*`` and ``save_*`` as in ``transformers.Trainer``;
        an epoch is one pass over the training prompts.

        Args:
            resume_from_checkpoint: a checkpoint folder, or True (or ``"true"``) for the newest intact one
                in ``output_dir``; ``None`` uses ``args.resume_from_checkpoint``, False starts fresh. A fresh
                run into an ``output_dir`` holding checkpoints raises unless ``args.overwrite_output_dir``
                (see :mod:`trl_sae.trainer.checkpoints.folders`).
        """
        args = self.args
        self._begin_training(resume_from_checkpoint)
        steps_per_epoch = max(1, self.train_dataset_len // self.global_prompts_per_step)
        if args.eval_on_start and self.state.global_step == 0:
            self._evaluate_during_training()
        for step in range(self.state.global_step, args.num_total_batches):
            if step % steps_per_epoch == 0:
                self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            self.train_step(step)
            self.lr_scheduler.step()
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if (step + 1) % steps_per_epoch == 0:
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            last = self.control.should_training_stop or self.state.global_step >= args.num_total_batches
            if self.control.should_log or (last and args.logging_strategy != "no"):
                self._flush_logs()
            if self.control.should_evaluate:
                self._evaluate_during_training()
            if self.control.should_save:
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)

    def _evaluate_during_training(self) -> dict[str, float]:
        # On a forked RNG, so evaluating (or not) never changes the training samples that follow.
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return self.evaluate()

    def _begin_training(self, resume_from_checkpoint: str | bool | None) -> None:
        args = self.args
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        resume = parse_resume_flag(resume_from_checkpoint)
        # resume=True before the first checkpoint continues an interrupted value pretraining (PPO starts fresh).
        continues_pretraining = continues_value_pretraining(args, resume)
        checkpoint = self._plan_start(None if continues_pretraining else resume)
        self.state.global_step = 0
        self.state.episode = 0
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / (self.train_dataset_len * args.num_generations)
        self._pending_logs.clear()
        self._table_batch = None
        set_step_intervals(self.state, args)
        if checkpoint is not None:
            self._resume(checkpoint)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if checkpoint is None:  # value pretraining, or a pretrained critic (parts/value_pretrain.py)
            prepare_critic(self, self.value_pretraining(), resume=continues_pretraining)

    def value_pretraining(self) -> ValuePretraining:
        """This run's value pretraining (parts/value_pretrain.py), on its step phases (overrides included)."""
        compute = (self._compute_values, self._compute_boundaries, self._compute_advantages)
        return ValuePretraining(self, StepPhases(self._shared_prefix, *compute))

    # ------------------------------------------------------------------------------------------------
    # Checkpoints: thin methods over trl_sae/trainer/checkpoints/folders.py (manifests, which checkpoint a run
    # resumes from, what a resume refuses) and checkpoint_state.py (what a checkpoint holds, staged saves that
    # an interrupted or disk-full save never lets destroy the previous checkpoint, loading).
    # ------------------------------------------------------------------------------------------------
    def _checkpoint_state(self) -> CheckpointState:
        """The objects a checkpoint saves and a resume restores; the one place the trainer says what they are
        (the filter_groups prompt-stream position rides in ``self.state.stateful_callbacks``)."""
        return CheckpointState(
            accelerator=self.accelerator,
            model=self.model,
            lr_scheduler=self.lr_scheduler,
            progress=self.state,
            settings=self.args,
            train_prompts=self.train_dataset_len,
        )

    def _plan_start(self, resume: str | bool | None) -> str | None:
        """The checkpoint to resume from (None: fresh), the same on every process (see
        :func:`~trl_sae.trainer.checkpoints.state.plan_start`)."""
        return plan_start(self.accelerator, self.args, resume)

    def _save_checkpoint(self, model: nn.Module, trial: Any = None) -> str:
        """Save ``checkpoint-<global_step>`` (see :func:`~trl_sae.trainer.checkpoints.state.save_checkpoint`),
        then rotate the older ones. Every process calls it."""
        folder = save_checkpoint(
            self._checkpoint_state(), lambda output_dir: self.save_model(output_dir, _internal_call=True)
        )
        if self.accelerator.is_main_process:
            self._rotate_checkpoints()
        self.accelerator.wait_for_everyone()
        return folder

    def _sorted_checkpoints(self) -> list[Path]:
        return sorted_checkpoints(self.args.output_dir)

    def _rotate_checkpoints(self) -> None:
        """Keep the newest ``save_total_limit`` checkpoints, counting only steps up to the current one.

        A run starts with no checkpoint newer than its own (``_plan_start`` refuses or removes them), so
        the one just written is the newest and intact; the step filter keeps it safe even if a later-step
        folder appears from elsewhere.
        """
        rotate_checkpoints(self.args.output_dir, self.args.save_total_limit, self.state.global_step)

    def _resume(self, checkpoint: str) -> None:
        """Load a checkpoint that ``_plan_start`` chose and verified (see
        :func:`~trl_sae.trainer.checkpoints.state.load_checkpoint`)."""
        load_checkpoint(self._checkpoint_state(), checkpoint)
        self.rollouts.mark_weights_stale()  # the engine still holds the weights from before the load

    # Trainer.__init__ (not run here) sets this; Trainer's methods read it on every rank (Trainer._save did).
    is_distributed_loading_by_transformers: bool = False

    @property
    def critic_kind(self) -> str | None:
        """What the critic is, in words (a separate model, the shared-base adapter or the value head), as a
        checkpoint's model set-up and the Hub card state it; None when the estimator trains no critic."""
        kind = model_setup(self.accelerator.unwrap_model(self.model))["critic"]
        return None if kind == "none" else kind

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy and, with ``save_value_model``, the critic in ``value_model/``.

        A LoRA policy is saved as its adapter only, or merged into a full model with ``merge_adapters``.
        With ``push_to_hub``, a call from user code (not a checkpoint) then uploads ``output_dir`` (as
        ``transformers.Trainer.save_model`` does), for full and LoRA policies alike. Every process calls it.
        """
        output_dir = output_dir or self.args.output_dir
        save_peft = self._save_peft_policy if self.is_peft_model else None
        save_model_files(
            self.accelerator, self.model, self.args, self.processing_class, output_dir, save_peft
        )
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_peft_policy(
        self, unwrapped: nn.Module, output_dir: str, full_state: dict[str, torch.Tensor] | None = None
    ) -> None:
        save_peft_policy(
            self.accelerator,
            unwrapped,
            output_dir,
            self.processing_class,
            self.args.merge_adapters,
            full_state,
        )

    @contextmanager
    def null_ref_context(self):
        """The reference policy without a second copy of the weights: the base with every adapter disabled,
        or the adapter ``ref_adapter_name`` when set."""
        with reference_adapter(self.accelerator.unwrap_model(self.model).policy, self.ref_adapter_name):
            yield

    # ------------------------------------------------------------------------------------------------
    # Evaluation
    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset: Dataset | None = None, **kwargs: Any) -> dict[str, float]:
        """Mean reward and accuracy of one completion per eval prompt (at ``eval_temperature``, 0 = greedy; the
        training temperature by default; see :func:`~trl_sae.trainer.parts.evaluation.evaluate_policy`), logged and
        passed to the callbacks."""
        dataset = self.eval_dataset
        if eval_dataset is not None:
            dataset = self._prepare_prompt_dataset(eval_dataset, "eval_dataset")
        if dataset is None:
            raise ValueError("No `eval_dataset`: pass one to the trainer or to evaluate().")
        metrics = evaluate_policy(self.rollouts, dataset)
        self.log(dict(metrics))  # Trainer.log adds bookkeeping keys to the dict it is given
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics
