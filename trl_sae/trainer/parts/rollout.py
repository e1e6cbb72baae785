"""The rollout part of a PPO step: prompts -> a scored :class:`~trl_sae.trainer.rollout_batch.RolloutBatch`.

:class:`Rollouts` draws the step's prompts (a deterministic function of the step, so resuming needs only the
step count), samples completions with transformers' ``generate`` or vLLM, recomputes the old log-probs
teacher-forced where the sampler's numerics differ from the update's, scores them with the reward functions
(and reward model), and with ``filter_groups`` runs DAPO's dynamic-sampling rounds
(:mod:`~trl_sae.trainer.objectives.dynamic_sampling`). The trainer holds one as ``trainer.rollouts`` (built by
``SAEPPOTrainer._build_rollouts``) and evaluation samples and scores through the same object.

Its interface is the public methods: :meth:`Rollouts.collect` (one training step's batch), and the pieces
evaluation and the experience phases use, :meth:`~Rollouts.prompt_indices`, :meth:`~Rollouts.collate`,
:meth:`~Rollouts.sample`, :meth:`~Rollouts.score`, :meth:`~Rollouts.teacher_forced`. To change how completions
are sampled or scored, subclass :class:`Rollouts`, override the method, and return the subclass from an
``SAEPPOTrainer`` subclass's ``_build_rollouts`` (which passes every constructor argument)::

    class ShapedRollouts(Rollouts):
        def score(self, batch, synchronize=False):
            super().score(batch, synchronize)
            batch.scores = batch.scores + 0.1

    class MyTrainer(SAEPPOTrainer):
        def _build_rollouts(self, cls=ShapedRollouts):
            return super()._build_rollouts(cls)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from datasets import Dataset
from torch import nn
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, TrainerState
from transformers.utils import logging as hf_logging
from trl.models.utils import unwrap_model_for_generation

from trl_sae.generation.capture import forward_logprobs, fsdp2_root_unsharded, generate_with_logprobs
from trl_sae.generation.inputs import eval_mode, left_pad, sequence_inputs
from trl_sae.generation.vllm_backend import VLLMRollout
from trl_sae.rewards.protocol import compute_rewards_and_count, warn_zero_reward
from trl_sae.trainer.config import SAEPPOConfig
from trl_sae.trainer.objectives.dynamic_sampling import (
    batch_to,
    informative_groups,
    plan_transfers,
    prompt_stream_position,
    record_prompt_stream,
    sampling_metrics,
    select_groups,
    take_groups,
)
from trl_sae.trainer.objectives.losses import importance_sampling_weights
from trl_sae.trainer.objectives.shaping import overlong_penalty
from trl_sae.trainer.rollout_batch import RolloutBatch
from trl_sae.trainer.setup.precision import needs_teacher_forced_old_logprobs
from trl_sae.trainer.setup.vllm import rollout_mismatch_stats, vllm_sampling_seed

__all__ = ["Rollouts", "reward_model_scores"]

logger = hf_logging.get_logger(__name__)

RewardFunc = Callable[..., Sequence[float | None]]


def reward_model_scores(
    reward_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """``(B,)``: a sequence classifier's score of each sequence at its last real token.

    Runs ``reward_model``'s backbone and ``score`` head as TRL's ``get_reward`` does, but on the given
    ``attention_mask`` and ``position_ids`` (:func:`~trl_sae.generation.inputs.sequence_inputs`) rather than on
    ``input_ids != pad_token_id``, so a real token that equals the pad id is scored as the token it is.

    Args:
        reward_model: a ``*ForSequenceClassification`` with one label (``base_model_prefix`` backbone and a
            ``score`` head).
        input_ids, attention_mask, position_ids: ``(B, L)``; left-padded prompts, right-padded completions.
    """
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.bool() * positions).argmax(dim=1)  # the last real token of each row
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return reward_model.score(hidden[rows, last]).squeeze(-1)


class Rollouts:
    """Sampling and scoring for :class:`~trl_sae.SAEPPOTrainer`: prompts -> scored ``RolloutBatch``.

    Args:
        args: the run's config (read, never changed here).
        accelerator: the trainer's accelerator (device, processes, autocast, collectives).
        model: the prepared policy-and-critic wrapper (its ``.policy`` samples).
        processing_class: the tokenizer.
        train_dataset: the tokenised training prompts (``input_ids``, ``prompt`` and the reward columns).
        state: the trainer state: ``global_step`` (vLLM seeds, messages) and, with ``filter_groups``, the
            prompt-stream position recorded in it (saved with every checkpoint).
        generation_config: transformers' sampling config (evaluation swaps it for its own while it runs).
        stop_token_ids: the token ids that end a completion (evaluation builds its config from them).
        local_prompts_per_step: prompts per process and step; ``global_prompts_per_step``: over all processes.
        reward_funcs, reward_func_names, reward_weights: the validated reward functions, their names and weights.
        reward_model: a sequence classifier added to the reward, weighted by ``reward_model_weight``.
        vllm_rollout: the vLLM engine with ``use_vllm``, else None.
    """

    def __init__(
        self,
        *,
        args: SAEPPOConfig,
        accelerator: Accelerator,
        model: nn.Module,
        processing_class: PreTrainedTokenizerBase,
        train_dataset: Dataset,
        state: TrainerState,
        generation_config: GenerationConfig,
        stop_token_ids: list[int],
        local_prompts_per_step: int,
        global_prompts_per_step: int,
        reward_funcs: list[RewardFunc],
        reward_func_names: list[str],
        reward_weights: torch.Tensor,
        reward_model: PreTrainedModel | None = None,
        reward_model_weight: float = 1.0,
        vllm_rollout: VLLMRollout | None = None,
    ) -> None:
        self.args = args
        self.accelerator = accelerator
        self.model = model
        self.processing_class = processing_class
        self.train_dataset = train_dataset
        self.state = state
        self.generation_config = generation_config
        self.stop_token_ids = stop_token_ids
        self.local_prompts_per_step = local_prompts_per_step
        self.global_prompts_per_step = global_prompts_per_step
        self.reward_funcs = reward_funcs
        self.reward_func_names = reward_func_names
        self.reward_weights = reward_weights
        self.reward_model = reward_model
        self.reward_model_weight = reward_model_weight
        self.vllm_rollout = vllm_rollout
        # True when the vLLM engine holds older weights than the policy: sample() pushes them first.
        self.weights_stale = True
        self._warned_zero_reward = False  # every reward None for a whole batch: warned once per run
        self._warned_group_padding = False  # filter_groups padded with agreeing groups: warned once per run

    def mark_weights_stale(self) -> None:
        """The policy's weights changed (an optimizer step, a loaded checkpoint): with vLLM, the next
        :meth:`sample` pushes them to the engine first."""
        self.weights_stale = True

    def prompt_stream_position(self) -> int:
        """Prompt batches drawn by the steps before the current one (the step itself without ``filter_groups``;
        see :func:`~trl_sae.trainer.objectives.dynamic_sampling.prompt_stream_position`)."""
        return prompt_stream_position(self.state)

    # ------------------------------------------------------------------------------------------------
    # Prompt batches
    # ------------------------------------------------------------------------------------------------
    def prompt_indices(self, prompt_batch_index: int) -> list[int]:
        """Dataset rows this process uses for prompt batch ``prompt_batch_index`` of the training order (an
        epoch-wise shuffle seeded by ``args.data_seed``, or ``args.seed`` when unset)."""
        per_step = self.global_prompts_per_step
        steps_per_epoch = len(self.train_dataset) // per_step
        epoch, position = divmod(prompt_batch_index, steps_per_epoch)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        generator = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(len(self.train_dataset), generator=generator)
        start = position * per_step + self.accelerator.process_index * self.local_prompts_per_step
        return order[start : start + self.local_prompts_per_step].tolist()

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Left-pad prompts and repeat each row ``num_generations`` times."""
        repeats = self.args.num_generations
        ids, mask = left_pad([row["input_ids"] for row in rows], self.processing_class.pad_token_id)
        columns = {
            key: [row[key] for row in rows for _ in range(repeats)]
            for key in rows[0]
            if key not in ("prompt", "input_ids")
        }
        return {
            "prompts": [row["prompt"] for row in rows for _ in range(repeats)],
            "columns": columns,
            "prompt_ids": ids.repeat_interleave(repeats, dim=0),
            "prompt_mask": mask.repeat_interleave(repeats, dim=0),
        }

    # ------------------------------------------------------------------------------------------------
    # Sampling
    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompt_batch: dict[str, Any], recompute_logprobs: bool = True) -> RolloutBatch:
        """Sample completions, keeping each token's log-prob and entropy from the sampling distribution.

        Under mixed precision (or half-precision weights) the old log-probs and entropies are then recomputed
        teacher-forced, as the update computes them, unless ``recompute_logprobs`` is False (evaluation
        reads only the completions).
        """
        if self.vllm_rollout is not None:
            return self._sample_vllm(prompt_batch, recompute_logprobs)
        device = self.accelerator.device
        prompt_ids = prompt_batch["prompt_ids"].to(device)
        prompt_mask = prompt_batch["prompt_mask"].to(device)
        chunk = self.args.local_rollout_forward_batch_size
        wrapper = self.accelerator.unwrap_model(self.model)
        recompute = recompute_logprobs and needs_teacher_forced_old_logprobs(self.accelerator, wrapper.policy)
        # The head critic's old values come from the pass that gives the old log-probs: the recompute when
        # it runs, else each decoding step (whose last hidden state is the state before its token).
        capture = getattr(wrapper, "capture_values", None) if recompute_logprobs else None
        # A shared-base critic's value pass replays the unadapted layers generate computed, when no
        # teacher-forced pass (which records them itself) runs first.
        prefix = getattr(wrapper, "generation_prefix", None) if recompute_logprobs and not recompute else None
        outputs, values, prefixes = [], [], []
        with (
            unwrap_model_for_generation(
                self.model, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation
            ) as unwrapped,
            fsdp2_root_unsharded(unwrapped),
            self.accelerator.autocast(),  # the update's precision, so the first PPO ratio is 1
            eval_mode(unwrapped.policy) as policy,  # every submodule back in its own mode afterwards
        ):
            for start in range(0, prompt_ids.shape[0], chunk):
                with (
                    capture() if capture is not None and not recompute else nullcontext() as steps,
                    prefix() if prefix is not None else nullcontext() as states,
                ):
                    outputs.append(
                        generate_with_logprobs(
                            policy,
                            prompt_ids[start : start + chunk],
                            prompt_mask[start : start + chunk],
                            self.generation_config,
                        )
                    )
                if steps is not None:
                    values.append(steps.per_step(outputs[-1].completion_ids.shape[1]))
                if states is not None:
                    prefixes.append((slice(start, start + chunk), states))
        width = max(out.completion_ids.shape[1] for out in outputs)

        def stack(name: str, fill: float, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
            parts = parts if parts is not None else [getattr(out, name) for out in outputs]
            return torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=fill) for p in parts])

        batch = RolloutBatch(
            prompts=prompt_batch["prompts"],
            columns=prompt_batch["columns"],
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=stack("completion_ids", self.processing_class.pad_token_id),
            completion_mask=stack("completion_mask", 0).long(),
            logprobs=stack("logprobs", 0.0),
            entropies=stack("entropies", 0.0),
            is_truncated=torch.cat([out.is_truncated for out in outputs]),
            values=stack("values", 0.0, values) if values else None,
        )
        for rows, states in prefixes:  # keyed to the value pass's rows: the batch's width, not the chunk's
            states.seed(
                sequence_inputs(
                    prompt_ids[rows],
                    prompt_mask[rows],
                    batch.completion_ids[rows],
                    batch.completion_mask[rows],
                )
            )
        if recompute:
            # Below float32 the cached decoding steps round unlike the update's full forward (|log r| ~5e-4):
            # the old log-probs are recomputed as the update computes them; the sampler's are kept.
            batch.sampler_logprobs = batch.logprobs
            batch.logprobs, batch.entropies, batch.values = self._recompute(
                wrapper, prompt_ids, prompt_mask, batch.completion_ids, batch.completion_mask
            )
        return batch

    def _recompute(
        self,
        unwrapped: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The policy's teacher-forced old log-probs and entropies and, for a critic that reads the policy's
        own hidden states (the head critic), the old values from the same pass (else None)."""
        capture = getattr(unwrapped, "capture_values", None)
        with fsdp2_root_unsharded(unwrapped), capture() if capture is not None else nullcontext() as states:
            logprobs, entropies = self.teacher_forced(
                unwrapped.policy, prompt_ids, prompt_mask, completion_ids, completion_mask, True
            )
        values = states.teacher_forced(completion_ids.shape[1]) if states is not None else None
        return logprobs, entropies, values

    @torch.no_grad()
    def _sample_vllm(self, prompt_batch: dict[str, Any], recompute_logprobs: bool = True) -> RolloutBatch:
        """Sample with vLLM, then recompute the old log-probs (and entropies) with the trainer's forward.

        PPO's ratio must start at 1 under the trainer's own numerics, so ``batch.logprobs`` are the
        recompute; vLLM's go to ``batch.sampler_logprobs`` for the importance-sampling correction and the
        mismatch metrics. Probability segmentation reads ``batch.logprobs`` too (docs/design.md explains why).
        ``recompute_logprobs=False`` (evaluation, which reads only the completions) skips the trainer's forward:
        ``batch.logprobs`` are then vLLM's (0 where it gave none), with no entropies, correction or metrics.
        """
        args = self.args
        device = self.accelerator.device
        prompt_ids = prompt_batch["prompt_ids"].to(device)
        prompt_mask = prompt_batch["prompt_mask"].to(device)
        if self.weights_stale:
            self.vllm_rollout.sync_weights()
            self.weights_stale = False
        # Evaluation batches pass their own stream, so they never replay a training step's noise.
        stream, call = prompt_batch.get("vllm_seed_stream", ("train", 0))
        seed = vllm_sampling_seed(
            args.seed, self.state.global_step, self.accelerator.process_index, stream, call
        )
        sampled = self.vllm_rollout.generate(prompt_ids, prompt_mask, args.num_generations, seed)
        missing = sampled.logprob_missing
        values = None
        if recompute_logprobs:
            logprobs, entropies, values = self._recompute(
                self.accelerator.unwrap_model(self.model),
                prompt_ids,
                prompt_mask,
                sampled.completion_ids,
                sampled.completion_mask,
            )
            # A token vLLM gave no log-prob for takes the trainer's: ratio 1, no correction, no mismatch.
            sampler_logprobs = (
                sampled.logprobs if missing is None else torch.where(missing, logprobs, sampled.logprobs)
            )
        else:  # evaluation: vLLM's log-probs (0 where none), no entropies
            logprobs = sampled.logprobs
            if missing is not None:
                logprobs = torch.where(missing, torch.zeros_like(logprobs), logprobs)
            entropies, sampler_logprobs = torch.zeros_like(logprobs), None
        batch = RolloutBatch(
            prompts=prompt_batch["prompts"],
            columns=prompt_batch["columns"],
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=sampled.completion_ids,
            completion_mask=sampled.completion_mask,
            logprobs=logprobs,
            entropies=entropies,
            is_truncated=sampled.is_truncated,
            sampler_logprobs=sampler_logprobs,
            values=values,
        )
        if not recompute_logprobs:
            return batch
        if args.vllm_importance_sampling_correction:
            batch.importance_weights = importance_sampling_weights(
                batch.logprobs,
                batch.sampler_logprobs,
                batch.mask,
                args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min,
                args.vllm_importance_sampling_clip_max,
            )
        batch.rollout_stats = self._mismatch_stats(batch)
        return batch

    def _mismatch_stats(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Sums of the sampler-vs-trainer log-prob mismatch over ``batch``'s valid tokens (``rollout/*``)."""
        return rollout_mismatch_stats(
            batch.logprobs,
            batch.sampler_logprobs,
            batch.mask,
            self.args.segment_threshold,
            batch.importance_weights,
        )

    @torch.no_grad()
    def teacher_forced(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``model``'s log-probs (and entropies) of the completions, ``local_rollout_forward_batch_size`` rows
        at a time; ``(B, T)`` each. The caller enters whatever context ``model`` needs (the trainer's
        reference log-probs come from here too)."""
        chunk = self.args.local_rollout_forward_batch_size
        logprobs, entropies = [], []
        for start in range(0, prompt_ids.shape[0], chunk):
            part = slice(start, start + chunk)
            with self.accelerator.autocast():  # as the update's forward (accelerate autocasts only that one)
                part_logprobs, part_entropies = forward_logprobs(
                    model,
                    prompt_ids[part],
                    prompt_mask[part],
                    completion_ids[part],
                    completion_mask[part],
                    temperature=self.args.temperature,
                    return_entropy=entropy,
                    chunk_size=self.args.logprob_chunk_size,
                )
            logprobs.append(part_logprobs)
            entropies.append(part_entropies)
        return torch.cat(logprobs), torch.cat(entropies) if entropy else None

    # ------------------------------------------------------------------------------------------------
    # Scoring
    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, batch: RolloutBatch, synchronize: bool = False) -> None:
        """Outcome reward per completion from the reward functions (and the reward model, if any).

        Each reward-function call is bounded by ``args.reward_timeout``. With ``synchronize`` (training,
        where every process scores every step), the processes agree after scoring: if any of them failed
        (e.g. a timeout), all raise instead of the others waiting forever at the next collective.
        """
        ids_lists = [
            ids[mask.bool()].tolist() for ids, mask in zip(batch.completion_ids, batch.completion_mask)
        ]
        batch.completions = self.processing_class.batch_decode(ids_lists, skip_special_tokens=True)
        device = self.accelerator.device
        total = torch.zeros(len(ids_lists), device=device)
        failure: Exception | None = None
        num_scored = 0
        if self.reward_funcs:
            try:
                scores, per_function, num_scored = compute_rewards_and_count(
                    self.reward_funcs,
                    self.reward_weights,
                    batch.prompts,
                    batch.completions,
                    ids_lists,
                    batch.columns,
                    timeout=self.args.reward_timeout,
                )
            except Exception as error:
                if not (synchronize and self.accelerator.num_processes > 1):
                    raise
                failure = error
            else:
                total += scores.to(device)
                batch.reward_per_function = {name: value.to(device) for name, value in per_function.items()}
        if synchronize and self.accelerator.num_processes > 1:
            counts = torch.tensor([float(failure is not None), float(num_scored)], device=device)
            failed, num_scored = self.accelerator.reduce(counts, reduction="sum").tolist()
            if failure is not None:
                raise failure
            if failed:
                raise RuntimeError(
                    f"{int(failed)} other process(es) failed while scoring rewards at step "
                    f"{self.state.global_step + 1} (their error is in their log, e.g. a RewardTimeoutError); "
                    "this process stops too rather than wait for them at the next collective."
                )
        all_none = self.reward_funcs and self.reward_model is None and num_scored == 0 and ids_lists
        if all_none and not self._warned_zero_reward:
            self._warned_zero_reward = True
            warn_zero_reward(
                f"every reward function ({', '.join(self.reward_func_names)}) returned None for every "
                f"completion at step {self.state.global_step + 1}, so every completion scores 0 and the "
                "policy has no signal to learn from (shown once). Check that the dataset has the columns "
                "the functions need (e.g. `answer`) and that completions are long enough to answer."
            )
        if self.reward_model is not None:
            total += self.reward_model_weight * self._reward_model_scores(batch)
        batch.task_scores = total
        if self.args.missing_eos_penalty is not None:
            total = total - self.args.missing_eos_penalty * batch.is_truncated.float().to(device)
        if self.args.overlong_buffer_length > 0:  # DAPO's soft overlong punishment, logged on its own
            batch.overlong_penalty = overlong_penalty(
                batch.lengths.to(device),
                self.args.response_length,
                self.args.overlong_buffer_length,
                self.args.overlong_penalty_factor,
            )
            total = total + batch.overlong_penalty
        batch.scores = total

    def _reward_model_scores(self, batch: RolloutBatch) -> torch.Tensor:
        """The reward model's float score of each completion (also kept in ``batch.reward_per_function``).

        Scored with the sequence's own mask and positions (:func:`reward_model_scores`), not with TRL's
        ``get_reward``: that one rebuilds the mask as ``ids != pad_token_id``, so every real token
        equal to the pad id (pad = EOS = the chat template's end of message, e.g. SmolLM2's ``<|im_end|>``)
        was masked out and replaced by id 0, and the model scored another sequence than the one sampled.
        """
        sequence = sequence_inputs(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
        model_scores = reward_model_scores(self.reward_model, **sequence).float()
        batch.reward_per_function["reward_model"] = model_scores
        return model_scores

    # ------------------------------------------------------------------------------------------------
    # A training step's batch (dynamic sampling)
    # ------------------------------------------------------------------------------------------------
    def _scored(self, prompt_batch_index: int, vllm_seed_stream: tuple | None = None) -> RolloutBatch:
        """Rollouts and scores of prompt batch ``prompt_batch_index`` of the training order."""
        rows = [self.train_dataset[i] for i in self.prompt_indices(prompt_batch_index)]
        prompt_batch = self.collate(rows)
        if vllm_seed_stream is not None:
            prompt_batch["vllm_seed_stream"] = vllm_seed_stream
        batch = self.sample(prompt_batch)
        self.score(batch, synchronize=True)
        return batch

    def collect(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The step's scored rollouts: :meth:`sample` and :meth:`score` on the prompts of ``step``, or with
        ``filter_groups`` DAPO's dynamic sampling (:mod:`~trl_sae.trainer.objectives.dynamic_sampling`).

        Dynamic sampling runs generation rounds, each on the next prompt batch of the training order, until
        the processes together have ``global_prompts_per_step`` groups whose scores differ, or
        ``max_num_gen_batches`` rounds; processes with more than ``local_prompts_per_step`` of them then send
        the rest to the processes with fewer (:func:`~trl_sae.trainer.objectives.dynamic_sampling.plan_transfers`).
        Generation, scoring and the update are collectives (FSDP2, ZeRO-3, vLLM tensor parallelism,
        reward-failure agreement), so the processes agree after each round on the count (one all-gather of
        one number each) and all run the same rounds. Returns the batch and the ``dynamic_sampling/*``
        metrics (none without the filter).
        """
        args = self.args
        if not args.filter_groups:
            return self._scored(step), {}
        position = self.prompt_stream_position()
        needed = self.local_prompts_per_step
        rounds: list[RolloutBatch] = []
        informative: list[torch.Tensor] = []
        while True:
            # round 0 samples as an unfiltered step would
            batch = self._scored(position + len(rounds), vllm_seed_stream=("train", len(rounds)))
            rounds.append(batch)
            informative.append(informative_groups(batch.scores, args.num_generations).cpu())
            counts = [sum(int(flags.sum()) for flags in informative)]
            if self.accelerator.num_processes > 1:
                local = torch.tensor([float(counts[0])], device=self.accelerator.device)
                counts = [int(count) for count in self.accelerator.gather(local).tolist()]
            if len(rounds) >= args.max_num_gen_batches or sum(counts) >= self.global_prompts_per_step:
                break
        # Valid for the next step only (train_step advances global_step by one after this).
        record_prompt_stream(self.state, self.state.global_step + 1, position + len(rounds))
        transfers = plan_transfers(counts, needed)
        rank = self.accelerator.process_index
        selection = select_groups(
            informative, needed, received=sum(n for _, to, n in transfers if to == rank)
        )
        received = self._exchange_groups(rounds, selection.spare, transfers) if transfers else []
        picks = selection.picks + [
            (len(rounds) + i, g)
            for i, piece in enumerate(received)
            for g in range(len(piece.prompts) // args.num_generations)
        ]
        batch = take_groups(
            rounds + received, picks, args.num_generations, self.processing_class.pad_token_id
        )
        if rounds[0].rollout_stats:  # the vLLM mismatch sums, over the rows kept
            batch.rollout_stats = self._mismatch_stats(batch)
        sent = sum(n for source, _, n in transfers if source == rank)
        totals = selection.counts() - torch.tensor([0.0, 0.0, 0.0, float(sent)], dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals.to(self.accelerator.device), reduction="sum").cpu()
        metrics = sampling_metrics(totals, len(rounds))
        if metrics["dynamic_sampling/groups_padded"] and not self._warned_group_padding:
            self._warned_group_padding = True
            logger.warning(
                "filter_groups: after max_num_gen_batches=%d generation rounds at step %d, %d prompt group(s) "
                "whose rewards all agree were trained on to fill the batch (shown once; "
                "dynamic_sampling/groups_padded counts them every step). Raise max_num_gen_batches or check "
                "that the rewards can tell completions apart.",
                args.max_num_gen_batches,
                self.state.global_step + 1,
                int(metrics["dynamic_sampling/groups_padded"]),
            )
        return batch, metrics

    def _exchange_groups(
        self,
        rounds: list[RolloutBatch],
        spare: list[tuple[int, int]],
        transfers: list[tuple[int, int, int]],
    ) -> list[RolloutBatch]:
        """Send this process's share of ``transfers`` (taken from its ``spare`` informative groups, in round
        order) and return the groups sent to it, one batch per sender in process order (on this device).
        One all-gather of the moved rows (on the CPU); every process takes part."""
        rank = self.accelerator.process_index
        outgoing: list[tuple[int, RolloutBatch]] = []
        offset = 0
        for source, destination, count in transfers:
            if source != rank:
                continue
            piece = take_groups(
                rounds,
                sorted(spare[offset : offset + count]),
                self.args.num_generations,
                self.processing_class.pad_token_id,
            )
            outgoing.append((destination, batch_to(piece, "cpu")))
            offset += count
        everything = gather_object([outgoing])  # one list per process, in process order
        return [
            batch_to(piece, self.accelerator.device)
            for sent in everything
            for destination, piece in sent
            if destination == rank
        ]
