"""The PPO update: a scored, advantaged :class:`RolloutBatch` -> optimizer steps -> loss statistics.

The loop, as CleanRL's ``ppo.py`` writes it (:meth:`PPOUpdate.run`)::

    for epoch in range(num_ppo_epochs):
        for mini_batch in shuffled rows, split in local_mini_batch_size:   # one optimizer step each
            for micro_batch in mini_batch:                                 # gradients accumulate
                loss = L^CLIP - c_H S + c_NLL L^NLL + c_V L^VF                 # PPOUpdate.loss
                backward(loss)                 # after every process agreed the loss is finite
            clip gradients (actor and critic apart); optimizer.step()

The trainer holds one :class:`PPOUpdate` as ``trainer.ppo_update`` (built by
``SAEPPOTrainer._build_ppo_update``) and calls ``run(batch, step)`` once per training step. The optimizer
and the learning-rate scheduler stay the trainer's (where transformers' callbacks and checkpoints expect
them); the update only steps the optimizer it was given.

To change the loss, subclass :class:`PPOUpdate`, override :meth:`~PPOUpdate.loss` (or :meth:`~PPOUpdate.run`)
and return an instance from an ``SAEPPOTrainer`` subclass's ``_build_ppo_update``::

    class L2Update(PPOUpdate):
        def loss(self, batch, index, train_actor, with_critic=True, denominator=None):
            loss, stats = super().loss(batch, index, train_actor, with_critic, denominator)
            return loss + 1e-4 * sum(p.square().sum() for p in self.model.parameters()), stats

    class L2Trainer(SAEPPOTrainer):
        def _build_ppo_update(self):
            return L2Update(self.accelerator, self.model, self.optimizer, self.args)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from trl_sae.generation.inputs import sequence_inputs
from trl_sae.trainer.config import SAEPPOConfig
from trl_sae.trainer.critics.policy_and_critic import SharedBaseCritic
from trl_sae.trainer.objectives.losses import (
    clip_fractions,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_bonus,
    loss_units,
    masked_mean,
    positive_nll_loss,
    process_denominator,
)
from trl_sae.trainer.objectives.shaping import high_entropy_mask
from trl_sae.trainer.rollout_batch import RolloutBatch
from trl_sae.trainer.setup.precision import clip_grad_norms

__all__ = [
    "PPOUpdate",
    "token_budget_micro_batches",
]

# Loss terms with their own token mask and denominator (the entropy bonus shares the policy's).
LOSS_TERMS = ("policy", "value", "positive_nll")

Failure = tuple[list[str], str]  # a non-finite loss: the terms that are, and where (see _check_finite_loss)
MicroBatches = list[tuple[torch.Tensor, bool]]  # one mini-batch's (row indices, padding) micro-batches


def token_budget_micro_batches(
    prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, max_tokens: int
) -> list[torch.Tensor]:
    """Group rows by length into micro-batches of at most ``max_tokens`` padded tokens.

    A micro-batch of ``n`` rows trimmed to its own longest rows costs ``n x (longest prompt + longest
    completion)`` tokens. Rows are taken longest completion first and a micro-batch is closed when the next
    row would push it over the budget, so long rows share a micro-batch with few others and short rows are
    packed many to one. A single row longer than the budget goes alone in its micro-batch.

    Args:
        prompt_lengths: ``(N,)`` valid prompt tokens of each row.
        completion_lengths: ``(N,)`` valid completion tokens of each row.
        max_tokens: the budget, >= 1.

    Returns:
        Index tensors into the ``N`` rows (long, on the inputs' device), covering each row once.
    """
    prompts, completions = prompt_lengths.tolist(), completion_lengths.tolist()
    order = sorted(range(len(prompts)), key=lambda row: (-completions[row], -prompts[row]))
    groups: list[list[int]] = []
    longest_prompt = longest_completion = 0
    for row in order:
        prompt, completion = max(longest_prompt, prompts[row]), max(longest_completion, completions[row])
        if groups and (len(groups[-1]) + 1) * (prompt + completion) <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
            prompt, completion = prompts[row], completions[row]
        longest_prompt, longest_completion = prompt, completion
    return [torch.tensor(group, dtype=torch.long, device=completion_lengths.device) for group in groups]


class PPOUpdate:
    """PPO epochs over shuffled mini-batches, one optimizer step per mini-batch.

    Each mini-batch is split into micro-batches (:meth:`micro_batches`) whose gradients accumulate; every
    micro-batch's loss is its share of the mini-batch's ``loss_agg_mode`` aggregate (divided by the count of
    the whole mini-batch on all processes, times the number of processes because DDP averages gradients), so
    the step is the same however the mini-batch is split. Every process runs as many micro-batches as the
    process with the most (padding micro-batches add nothing).

    Args:
        accelerator: the trainer's (backward, gradient synchronisation, collectives, clipping).
        model: the prepared policy-and-critic wrapper (``forward(..., with_policy, with_critic)`` returns
            ``((logprobs, entropy) | None, values | None)``).
        optimizer: the prepared optimizer; stepped once per mini-batch.
        args: the run's config, read at every call (tests and benchmarks change fields between calls).

    Attributes:
        on_mini_batch: called with no argument after each optimizer step of :meth:`run` (value
            pretraining moves its progress bar with it; an epoch of a large bank takes minutes).
    """

    on_mini_batch: Callable[[], None] | None = None

    def __init__(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        args: SAEPPOConfig,
    ) -> None:
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.args = args

    # ------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------
    def trains_actor(self, step: int) -> bool:
        """Whether the update at ``step`` (0-based, the steps done so far) trains the policy: not during the
        critic's ``value_warmup_steps``."""
        return step >= self.args.value_warmup_steps

    def run(self, batch: RolloutBatch, step: int) -> dict[str, torch.Tensor]:
        """Train on ``batch`` (scored, with values, advantages and returns); the mean of each statistic.

        Sets ``batch.loss_masks`` (:meth:`loss_masks`). ``step``: the steps done so far (decides
        :meth:`trains_actor` and names the step in a non-finite-loss error).
        """
        args = self.args
        train_actor = self.trains_actor(step)
        batch.loss_masks = self.loss_masks(batch)
        terms = [term for term in LOSS_TERMS if term in batch.loss_masks]
        self.model.train()
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        for _ in range(args.num_ppo_epochs):
            for micro_batches, denominator in self._mini_batches(batch, terms):
                mini_stats = self._accumulate_gradients(batch, micro_batches, train_actor, denominator, step)
                self._clip_gradients()
                self.optimizer.step()
                self.optimizer.zero_grad()
                for key, value in mini_stats.items():
                    stats[key].append(value)
                if self.on_mini_batch is not None:
                    self.on_mini_batch()
        self.accelerator.gradient_state._set_sync_gradients(True)
        return {key: torch.stack(values).mean() for key, values in stats.items()}

    def _mini_batches(
        self, batch: RolloutBatch, terms: list[str]
    ) -> list[tuple[MicroBatches, dict[str, torch.Tensor]]]:
        """One epoch's shuffled mini-batches, each as its micro-batches and the loss terms' denominators; the
        processes agree on both in one all-gather.

        Each term's denominator is its count of units (:func:`~trl_sae.trainer.objectives.losses.loss_units`; the
        positive NLL's rows are the positive completions only, VAPO's normalisation) in the mini-batch over
        all processes, divided by their number.
        """
        args = self.args
        accelerator = self.accelerator
        order = torch.randperm(batch.completion_ids.shape[0], device=batch.completion_ids.device)
        minis = list(torch.split(order, args.local_mini_batch_size))
        splits = [self.micro_batches(batch, mini) for mini in minis]
        units = torch.stack([self._mini_batch_units(batch, mini, terms) for mini in minis])  # (minis, terms)
        counts = torch.tensor([len(micros) for micros in splits], dtype=units.dtype, device=units.device)
        if accelerator.num_processes > 1:
            # Each mini-batch's counts summed over the processes, and the most micro-batches any has for it.
            gathered = accelerator.gather(torch.cat([units.flatten(), counts])[None])
            size = units.numel()
            units = gathered[:, :size].sum(dim=0).view(len(minis), len(terms))
            counts = gathered[:, size:].amax(dim=0)
        plan = []
        for mini, micros, mini_units, count in zip(minis, splits, units, counts.tolist()):
            shares = process_denominator(mini_units, accelerator.num_processes)
            padded = self._pad_micro_batches(batch, mini, micros, int(count))
            plan.append((padded, dict(zip(terms, shares.unbind()))))
        return plan

    def _mini_batch_units(self, batch: RolloutBatch, mini: torch.Tensor, terms: list[str]) -> torch.Tensor:
        """``(terms,)``: each loss term's count of units in this process's rows ``mini``."""
        args = self.args
        return torch.stack(
            [
                loss_units(
                    batch.loss_masks[term][mini],
                    args.loss_agg_mode,
                    args.response_length,
                    masked_rows_only=term == "positive_nll",
                )
                for term in terms
            ]
        )

    def micro_batches(self, batch: RolloutBatch, mini: torch.Tensor) -> list[torch.Tensor]:
        """The micro-batches of one mini-batch (``mini``: ``(M,)`` row indices of ``batch``).

        Fixed ``per_device_train_batch_size`` rows, or with ``max_tokens_per_microbatch`` the groups of
        :func:`token_budget_micro_batches` (each then trimmed to its own longest row in :meth:`loss`).
        """
        args = self.args
        if args.max_tokens_per_microbatch is None:
            return list(torch.split(mini, args.per_device_train_batch_size))
        groups = token_budget_micro_batches(
            batch.prompt_mask[mini].sum(dim=1), batch.lengths[mini], args.max_tokens_per_microbatch
        )
        return [mini[group] for group in groups]

    @staticmethod
    def _pad_micro_batches(
        batch: RolloutBatch, mini: torch.Tensor, micros: list[torch.Tensor], count: int
    ) -> MicroBatches:
        """``micros`` followed by padding micro-batches up to ``count``, each as ``(row indices, padding)``.

        With ``max_tokens_per_microbatch`` the processes split their rows into different numbers of
        micro-batches, but FSDP2 and ZeRO-3 gather parameters in every forward and backward (ZeRO-2 reduces
        in every backward): a process that stopped early would leave the others waiting forever. A padding
        micro-batch is the mini-batch's shortest row with its loss scaled to exactly 0, so it runs the same
        collectives and adds nothing to the loss, the gradients or the statistics.
        """
        shortest = mini[batch.lengths[mini].argmin()].view(1)
        return [(micro, False) for micro in micros] + [(shortest, True)] * (count - len(micros))

    def _accumulate_gradients(
        self,
        batch: RolloutBatch,
        micros: MicroBatches,
        train_actor: bool,
        denominator: dict[str, torch.Tensor],
        step: int,
    ) -> dict[str, torch.Tensor]:
        """Forward and backward every micro-batch of one mini-batch; the mini-batch's statistics (loss terms
        are shares of its loss and add up; the others are micro-batch means)."""
        accelerator = self.accelerator
        mini_stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        failure: Failure | None = None
        for position, (micro, padding) in enumerate(micros):
            last = position == len(micros) - 1
            # Gradients are synchronised (DDP) and stepped only on the mini-batch's last micro-batch; the
            # number of real micro-batches may differ between processes (token budget), so this is set here
            # rather than counted by accelerator.accumulate.
            accelerator.gradient_state._set_sync_gradients(last)
            with nullcontext() if last else accelerator.no_sync(self.model):
                micro_stats, failure = self._backward_micro_batch(
                    batch, micro, train_actor, denominator, last, failure, step, padding=padding
                )
            for key, value in micro_stats.items():
                mini_stats[key].append(value)
        return {
            key: torch.stack(values).sum() if key.startswith("loss/") else torch.stack(values).mean()
            for key, values in mini_stats.items()
        }

    def _backward_micro_batch(
        self,
        batch: RolloutBatch,
        index: torch.Tensor,
        train_actor: bool,
        denominator: dict[str, torch.Tensor] | None,
        last: bool,
        failure: Failure | None,
        step: int,
        padding: bool = False,
    ) -> tuple[dict[str, torch.Tensor], Failure | None]:
        """Loss and backward for one micro-batch (``denominator``: see :meth:`loss`).

        Returns its statistics and the first non-finite-loss report of this mini-batch so far (see
        :meth:`_check_finite_loss`; the processes agree on it before the synchronised ``last`` backward).
        A ``padding`` micro-batch (see :meth:`_pad_micro_batches`) runs forward and backward with its loss
        times 0 and returns no statistics.
        """
        if not self.checkpointed_shared_critic():
            loss, stats = self.loss(batch, index, train_actor, denominator=denominator)
            if padding:
                loss, stats = loss * 0.0, {}
            failure = self._check_finite_loss(loss, stats, batch, step, last, failure)
            if failure is None:
                self._backward(loss)
            else:
                # Only a non-last micro-batch of a multi-process run gets here. Its backward still runs, so
                # this process's collectives (FSDP2 gathers parameters in backward) stay in step with the
                # others'; the (non-finite) gradients are never applied: every process raises at the
                # mini-batch's last micro-batch, before its backward and the optimizer step.
                self._backward(loss * 0.0)
            return stats, failure
        # Shared critic under gradient checkpointing: each adapter's forward and backward run while that
        # adapter is active, so recomputed layers use the right adapter and both passes stay checkpointed.
        stats: dict[str, torch.Tensor] = {}
        if train_actor:
            loss, stats = self.loss(batch, index, train_actor, with_critic=False, denominator=denominator)
            failure = self._check_finite_loss(loss, stats, batch, step, True, failure)
            self._backward(loss)
        with self.accelerator.unwrap_model(self.model).critic_adapter_active():
            loss, critic_stats = self.loss(
                batch, index, train_actor=False, with_critic=True, denominator=denominator
            )
            failure = self._check_finite_loss(loss, critic_stats, batch, step, True, failure)
            self._backward(loss)
        return {**stats, **critic_stats}, failure

    def _backward(self, loss: torch.Tensor) -> None:
        # accelerator.backward divides by gradient_accumulation_steps (DeepSpeed's engine does the same);
        # the loss is already the micro-batch's share of the mini-batch's loss, so that is undone.
        self.accelerator.backward(loss * self.accelerator.gradient_accumulation_steps)

    def _check_finite_loss(
        self,
        loss: torch.Tensor,
        stats: dict[str, torch.Tensor],
        batch: RolloutBatch,
        step: int,
        synchronize: bool = True,
        failure: Failure | None = None,
    ) -> Failure | None:
        """Stop before a NaN/inf loss reaches the weights (e.g. a reward of 1e30, or a NaN from the model).

        Runs before ``backward`` because under DeepSpeed ``accelerator.backward`` also steps the
        optimizer. On one process it raises at once. With several processes the micro-batches before a
        mini-batch's last one (whose counts may differ between processes) only record this process's
        first failure (the non-finite terms and a description), which is returned and passed back in (the
        caller runs that backward on a zeroed loss); at ``synchronize`` the processes agree (one small
        all-reduce per mini-batch), so every process raises together instead of the others hanging in the
        next collective.
        """
        if failure is None:
            terms = {key: stats[key] for key in ("loss/policy", "loss/value") if key in stats}
            terms["loss"] = loss.detach()  # also covers the entropy bonus
            bad = [not torch.isfinite(value.float()).item() for value in terms.values()]
            if any(bad):
                named = [key for key, flag in zip(terms, bad) if flag and key != "loss"] or ["loss"]
                values = ", ".join(f"{key}={terms[key].item()}" for key in named)
                failure = (named, f"{values} on process {self.accelerator.process_index}")
        named = failure[0] if failure is not None else []
        if self.accelerator.num_processes > 1:
            if not synchronize:
                return failure
            keys = ("loss/policy", "loss/value", "loss")
            flags = torch.tensor([float(key in named) for key in keys], device=loss.device)
            flags = self.accelerator.reduce(flags, reduction="sum")
            named = [key for key, flag in zip(keys, flags.tolist()) if flag and key != "loss"]
            named = named or (["loss"] if flags.any() else [])
        if not named:
            return None
        where = failure[1] if failure is not None else "on another process; see its log"
        scores = batch.scores.float() if batch.scores is not None else torch.zeros(1)
        raise FloatingPointError(
            f"non-finite {' and '.join(named)} at step {step + 1} ({where}); stopped before its backward "
            f"pass and optimizer step, so no NaN/inf reached the weights. This step's rewards span "
            f"[{scores.min().item():g}, {scores.max().item():g}]: rewards so large that their square overflows "
            "float32 (|r| > ~1e19) make the value loss inf; rescale them. Otherwise a NaN came from the model "
            "(try a lower learning rate, max_grad_norm, or bf16 instead of fp16)."
        )

    def checkpointed_shared_critic(self) -> bool:
        """Whether each micro-batch runs the actor's and the shared critic's forward and backward apart (a
        shared-base critic under gradient checkpointing, on one process without DeepSpeed)."""
        # Two backward passes per micro-batch are fine on one process; DDP expects one, so several
        # processes keep the single pass (the critic then keeps its activations). So does DeepSpeed: its
        # engine steps the optimizer inside the backward of a boundary micro-batch, so a second backward
        # there would be a second optimizer step.
        unwrapped = self.accelerator.unwrap_model(self.model)
        return (
            isinstance(unwrapped, SharedBaseCritic)
            and unwrapped.is_gradient_checkpointing
            and self.accelerator.num_processes == 1
            and self.accelerator.distributed_type != DistributedType.DEEPSPEED
        )

    def _clip_gradients(self) -> None:
        # As transformers.Trainer: max_grad_norm None or <= 0 means no clipping (0 is not "clip to 0").
        max_grad_norm = self.args.max_grad_norm
        if not (max_grad_norm and max_grad_norm > 0):
            return
        # Actor and critic are clipped separately: one global norm would let the critic's larger
        # gradients shrink the actor's step.
        unwrapped = self.accelerator.unwrap_model(self.model)
        groups = (unwrapped.actor_parameters(), unwrapped.critic_parameters())
        clip_grad_norms(self.accelerator, groups, max_grad_norm)  # one fp16 unscale for both

    # ------------------------------------------------------------------------------------------------
    # The loss
    # ------------------------------------------------------------------------------------------------
    def loss_masks(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """The ``(B, T)`` bool tokens each loss term of :meth:`loss` sums over (the RLVR knobs).

        ``"value"``: every valid token (the critic also learns from truncated completions). ``"policy"``: the
        valid tokens, without truncated completions under ``mask_truncated_completions`` (TRL's GRPO);
        the surrogate and the entropy bonus divide by its count. ``"positive_nll"`` (``positive_nll_coef >
        0``): the policy tokens of completions rewarded above ``positive_nll_threshold`` (VAPO).
        ``"high_entropy"`` (``top_entropy_quantile < 1``): the policy tokens in the top quantile of the
        rollout's entropies over every process's batch (one all-gather), the only ones whose surrogate and
        bonus terms count.
        """
        args = self.args
        mask = batch.mask
        policy = mask
        if args.mask_truncated_completions:
            policy = mask & ~batch.is_truncated.to(mask.device)[:, None]
        masks = {"policy": policy, "value": mask}
        if args.positive_nll_coef > 0:
            masks["positive_nll"] = (
                policy & (batch.scores > args.positive_nll_threshold).to(mask.device)[:, None]
            )
        if args.top_entropy_quantile < 1.0:
            gather_valid = self._gather_valid_entropies if self.accelerator.num_processes > 1 else None
            masks["high_entropy"] = high_entropy_mask(
                batch.entropies, policy, args.top_entropy_quantile, gather_valid
            )
        return masks

    def _gather_valid_entropies(self, local: torch.Tensor) -> torch.Tensor:
        sentinel = -1e9  # below any entropy, as TRL's get_high_entropy_mask pads
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=sentinel)
        gathered = self.accelerator.gather(padded)
        return gathered[gathered != sentinel]

    def loss(
        self,
        batch: RolloutBatch,
        index: torch.Tensor,
        train_actor: bool,
        with_critic: bool = True,
        denominator: dict[str, torch.Tensor | float] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's loss and statistics: ``L^CLIP - c_H S + c_NLL L^NLL + c_V L^VF``.

        The terms are in :mod:`trl_sae.trainer.objectives.losses`, each beside its equation: the clipped surrogate
        ``L^CLIP`` (paper Eq. 1, PPO Eq. 7), the entropy bonus ``S`` (PPO Eq. 9; ``entropy_coef``), VAPO's
        positive-example NLL (``positive_nll_coef``) and the clipped value loss ``L^VF`` (PPO Eq. 9;
        ``vf_coef``). Each is aggregated by ``loss_agg_mode`` over its tokens in ``batch.loss_masks`` (every
        valid token when absent). ``train_actor=False`` skips the policy terms, ``with_critic=False`` the
        value term.

        ``denominator`` maps each term (``"policy"``, ``"value"``, ``"positive_nll"``) to the count (of tokens
        or completions, per :func:`~trl_sae.trainer.objectives.losses.loss_units`) that its sum is divided by; :meth:`run`
        passes the mini-batch's over all processes divided by their number. ``None``: this micro-batch's own
        counts. With ``max_tokens_per_microbatch`` the rows are trimmed to the micro-batch's longest prompt and
        completion first.
        """
        args = self.args
        inputs, num_tokens = self._micro_batch_inputs(batch, index)
        policy_out, values = self.model(
            **inputs,
            num_completion_tokens=num_tokens,
            with_policy=train_actor,
            with_critic=args.uses_critic and with_critic,
            temperature=args.temperature,
        )
        micro = _MicroBatch(batch, index, num_tokens, denominator, args)
        loss = torch.zeros((), device=micro.mask.device)
        stats: dict[str, torch.Tensor] = {}
        if policy_out is not None:
            loss = self._add_policy_terms(loss, stats, micro, *policy_out)
        if values is not None:
            value_loss = clipped_value_loss(
                values,
                micro.rows(batch.values),
                micro.rows(batch.returns),
                micro.term_mask("value"),
                args.cliprange_value,
                **micro.agg("value"),
            )
            loss = loss + args.vf_coef * value_loss
            stats["loss/value"] = value_loss.detach()
        return loss, stats

    def _micro_batch_inputs(
        self, batch: RolloutBatch, index: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], int]:
        """The model inputs of rows ``index`` and the number of completion columns they keep.

        With ``max_tokens_per_microbatch`` the columns no row uses are dropped (prompts are left-padded,
        completions right-padded).
        """
        prompt_ids, prompt_mask = batch.prompt_ids[index], batch.prompt_mask[index]
        completion_ids, completion_mask = batch.completion_ids[index], batch.completion_mask[index]
        num_tokens = completion_ids.shape[1]
        if self.args.max_tokens_per_microbatch is not None:
            num_tokens = max(int(completion_mask.sum(dim=1).max()), 1)
            prompt_start = prompt_ids.shape[1] - max(int(prompt_mask.sum(dim=1).max()), 1)
            prompt_ids, prompt_mask = prompt_ids[:, prompt_start:], prompt_mask[:, prompt_start:]
            completion_ids, completion_mask = completion_ids[:, :num_tokens], completion_mask[:, :num_tokens]
        return sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask), num_tokens

    def _add_policy_terms(
        self,
        loss: torch.Tensor,
        stats: dict[str, torch.Tensor],
        micro: _MicroBatch,
        new_logprobs: torch.Tensor,
        entropy: torch.Tensor,
    ) -> torch.Tensor:
        """``loss + L^CLIP - c_H S + c_NLL L^NLL`` (the actor's terms); their statistics go into ``stats``.

        ``new_logprobs`` and ``entropy``: the policy's, ``(b, t)`` (its head applied chunk by chunk: never
        ``(B, T, V)`` logits).
        """
        args, batch = self.args, micro.batch
        weights = batch.importance_weights
        old_logprobs, advantages = micro.rows(batch.logprobs), micro.rows(batch.advantages)
        policy_mask = micro.term_mask("policy")
        high_entropy = micro.term_mask("high_entropy") if "high_entropy" in batch.loss_masks else None
        policy_loss, clipfrac, approx_kl = clipped_policy_loss(
            new_logprobs,
            old_logprobs,
            advantages,
            policy_mask,
            args.cliprange,
            **micro.agg("policy"),
            importance_weights=None if weights is None else micro.rows(weights),
            cliprange_high=args.cliprange_high,
            token_mask=high_entropy,
        )
        loss = loss + policy_loss
        if args.entropy_coef > 0:  # on the surrogate's tokens, as TRL's GRPO
            bonus_terms = entropy if high_entropy is None else entropy * high_entropy
            loss = loss - args.entropy_coef * entropy_bonus(bonus_terms, policy_mask, **micro.agg("policy"))
        if args.positive_nll_coef > 0:
            nll = positive_nll_loss(
                new_logprobs, micro.term_mask("positive_nll"), **micro.agg("positive_nll")
            )
            loss = loss + args.positive_nll_coef * nll
            stats["loss/positive_nll"] = nll.detach()
        clip_low, clip_high = clip_fractions(
            new_logprobs, old_logprobs, advantages, policy_mask, args.cliprange, args.cliprange_high
        )
        stats["loss/policy"] = policy_loss.detach()
        stats["policy/clipfrac"] = clipfrac
        stats["policy/clipfrac_low"] = clip_low
        stats["policy/clipfrac_high"] = clip_high
        stats["policy/approx_kl"] = approx_kl
        stats["policy/entropy"] = masked_mean(entropy.detach(), micro.mask)
        return loss


class _MicroBatch:
    """Rows ``index`` of ``batch`` cut to their first ``num_tokens`` completion columns: the per-token tensors
    and the aggregation settings that the loss terms read."""

    def __init__(
        self,
        batch: RolloutBatch,
        index: torch.Tensor,
        num_tokens: int,
        denominator: dict[str, torch.Tensor | float] | None,
        args: SAEPPOConfig,
    ) -> None:
        self.batch, self.index, self.columns = batch, index, slice(0, num_tokens)
        self.denominator, self.args = denominator, args
        self.mask = batch.completion_mask[index][:, :num_tokens].bool()

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        return values[self.index][:, self.columns]

    def term_mask(self, term: str) -> torch.Tensor:
        """The tokens loss term ``term`` sums over (every valid token when ``batch.loss_masks`` lacks it)."""
        return self.rows(self.batch.loss_masks[term]) if term in self.batch.loss_masks else self.mask

    def agg(self, term: str) -> dict[str, Any]:
        """``loss_agg_mode``, its length and term ``term``'s denominator: the aggregation keywords."""
        return {
            "loss_agg_mode": self.args.loss_agg_mode,
            "norm_length": self.args.response_length,
            "denominator": None if self.denominator is None else self.denominator[term],
        }
