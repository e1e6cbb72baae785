"""The experience phase that turns a scored batch into training targets: token rewards (the score on the last
token, minus the KL penalty), the actor's advantages from the configured estimator (paper Eq. 6 for SAE;
:mod:`trl_sae.core.advantages`) and the critic's GAE(``critic_lam``) returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from trl_sae.core.advantages import gae_advantages, get_advantage_estimator
from trl_sae.trainer.objectives.losses import kl_penalty, masked_whiten

if TYPE_CHECKING:
    from trl_sae.trainer.config import SAEPPOConfig
    from trl_sae.trainer.rollout_batch import RolloutBatch

__all__ = ["compute_advantages"]


def compute_advantages(
    batch: RolloutBatch,
    args: SAEPPOConfig,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Fill ``batch.token_rewards``, ``raw_advantages``, ``advantages`` and ``returns`` (each ``(B, T)``) from its
    scores, log-probs, values and boundaries. ``all_reduce_sum`` sums a tensor over processes, so whitening
    takes its moments over every process's valid tokens (None: this process only)."""
    mask = batch.mask
    rewards = torch.zeros_like(batch.logprobs)
    last = (batch.lengths - 1).clamp_min(0)
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += batch.scores * (batch.lengths > 0)
    if batch.ref_logprobs is not None:
        kl = kl_penalty(batch.logprobs, batch.ref_logprobs, args.kl_estimator)
        rewards = rewards - args.kl_coef * torch.where(mask, kl, torch.zeros_like(kl))
    if args.whiten_rewards:
        # As TRL's PPO: divide the token rewards by their (sample) std over the valid tokens, keeping their
        # mean; the actor's advantages and the critic's returns both use the scaled rewards.
        rewards = masked_whiten(rewards, mask, shift_mean=False, unbiased=True, all_reduce_sum=all_reduce_sum)
    batch.token_rewards = rewards
    estimator = get_advantage_estimator(args.advantage_estimator)
    advantages, _ = estimator(
        rewards=rewards,
        values=batch.values,
        mask=mask,
        boundaries=batch.boundaries,
        scores=batch.scores,
        lam=args.lam,
        gamma=args.gamma,
        num_generations=args.num_generations,
        adaptive_lambda_alpha=args.adaptive_lambda_alpha,
        grpo_scale=args.grpo_scale,
    )
    batch.raw_advantages = advantages
    if args.whiten_advantages and args.estimator_spec.whitens:
        advantages = masked_whiten(advantages, mask, all_reduce_sum=all_reduce_sum)
    batch.advantages = advantages
    _, batch.returns = gae_advantages(rewards, batch.values, mask, lam=args.critic_lam, gamma=args.gamma)
