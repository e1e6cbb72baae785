"""The trainer's numerics under mixed precision: which rollouts need their old log-probs recomputed.

accelerate autocasts only the prepared model's ``forward`` (the PPO update); the trainer enters
``accelerator.autocast()`` around its other passes (generation, the old-log-prob recompute, the reference
and the critic's old values), so every forward of the policy runs at the update's precision.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn

__all__ = ["needs_teacher_forced_old_logprobs"]


def needs_teacher_forced_old_logprobs(accelerator: Accelerator, policy: nn.Module) -> bool:
    """Whether the log-probs captured while sampling can differ from the update's teacher-forced ones.

    In float32 they agree to ~1e-7. In bf16/fp16 (autocast, or half-precision weights) the cached one-token
    decoding steps round differently from the update's full-sequence forward (|log r| ~5e-4 on the tiny
    Qwen3), so the first PPO ratio would not be 1: such runs recompute the old log-probs teacher-forced,
    as the vLLM path always does.

    Args:
        accelerator: the trainer's; its ``mixed_precision`` is ``"no"``, ``"bf16"`` or ``"fp16"``.
        policy: the policy (any wrapper).

    Returns:
        True when some forward of the policy computes in less than float32.
    """
    if accelerator.mixed_precision != "no":
        return True
    return any(p.is_floating_point() and p.dtype != torch.float32 for p in policy.parameters())
