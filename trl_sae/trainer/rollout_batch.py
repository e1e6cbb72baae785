"""RolloutBatch: the one record a PPO step passes between its parts (rollout, experience phases, update)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RolloutBatch"]


@dataclass
class RolloutBatch:
    """Everything one PPO step knows about its samples; phases fill the fields in order.

    Shapes: ``B`` completions on this process (prompts x num_generations), ``P`` prompt tokens (left
    padded), ``T`` completion tokens (right padded).
    """

    prompts: list[Any]  # (B,) prompt as given in the dataset (text or chat messages)
    columns: dict[str, list[Any]]  # other dataset columns, aligned with prompts
    prompt_ids: torch.Tensor  # (B, P)
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, T) long, 1 on valid tokens incl. EOS
    logprobs: torch.Tensor  # (B, T) old log-probs from the sampling distribution
    entropies: torch.Tensor  # (B, T)
    is_truncated: torch.Tensor  # (B,) bool, no EOS within response_length
    completions: list[str] = field(default_factory=list)
    scores: torch.Tensor | None = None  # (B,) outcome reward
    task_scores: torch.Tensor | None = None  # (B,) the reward functions' weighted sum, before any penalty
    reward_per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    values: torch.Tensor | None = None  # (B, T)
    ref_logprobs: torch.Tensor | None = None  # (B, T)
    boundaries: torch.Tensor | None = None  # (B, T) bool
    token_rewards: torch.Tensor | None = None  # (B, T)
    raw_advantages: torch.Tensor | None = None  # (B, T) before whitening
    advantages: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T) critic targets
    timings: dict[str, float] = field(default_factory=dict)
    # vLLM rollouts and mixed precision: the sampler's own log-probs (``logprobs`` above are then the
    # trainer's teacher-forced recompute). vLLM only: the importance-sampling weights of the policy loss, and
    # the mismatch sums behind the rollout/* metrics.
    sampler_logprobs: torch.Tensor | None = None  # (B, T)
    importance_weights: torch.Tensor | None = None  # (B, T)
    rollout_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    # RLVR knobs: the overlong penalty included in ``scores``, and the (B, T) bool tokens each loss term sums
    # over ("policy", "value", "positive_nll"; "high_entropy": top_entropy_quantile's), set by PPOUpdate.run.
    overlong_penalty: torch.Tensor | None = None  # (B,)
    loss_masks: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def mask(self) -> torch.Tensor:
        return self.completion_mask.bool()

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)
