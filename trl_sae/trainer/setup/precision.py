"""The trainer's numerics under mixed precision: which rollouts need their old log-probs recomputed, and
gradient clipping of several parameter groups with one fp16 unscale.

accelerate autocasts only the prepared model's ``forward`` (the PPO update); the trainer enters
``accelerator.autocast()`` around its other passes (generation, the old-log-prob recompute, the reference
and the critic's old values), so every forward of the policy runs at the update's precision.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

__all__ = ["clip_grad_norms", "enable_cpu_fp16", "needs_teacher_forced_old_logprobs"]


def enable_cpu_fp16(accelerator: Accelerator) -> None:
    """Make ``mixed_precision="fp16"`` on CPU what it is on a GPU: float16 autocast and a ``GradScaler``.

    accelerate (1.15) turns neither on for a CPU device, so an fp16 run there silently trained in float32.
    torch autocasts float16 on CPU and has a CPU ``GradScaler``; this sets both as accelerate does for a
    GPU, before ``accelerator.prepare`` wraps the model's forward and the optimizer. DeepSpeed is left to
    accelerate; FSDP1 (which would need ``ShardedGradScaler``) is refused before this runs
    (:func:`~trl_sae.trainer.setup.distributed.check_fsdp_version`).

    Args:
        accelerator: a freshly built one, not yet used to prepare anything.
    """
    cpu_fp16 = accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu"
    if not cpu_fp16 or accelerator.native_amp or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return
    handler = accelerator.scaler_handler
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", **(handler.to_kwargs() if handler is not None else {}))


def needs_teacher_forced_old_logprobs(accelerator: Accelerator, policy: nn.Module) -> bool:
    """Whether the log-probs captured while sampling can differ from the update's teacher-forced ones.

    In float32 they agree to ~1e-7. In bf16/fp16 (autocast, or half-precision weights) the cached one-token
    decoding steps round differently from the update's full-sequence forward (|log r| ~5e-4 on the tiny
    Qwen3), so the first PPO ratio would not be 1: such runs recompute the old log-probs teacher-forced,
    as the vLLM path always does.

    What counts is the dtype a layer computes in, not the one its weights are stored in: a bitsandbytes
    4-bit layer stores packed integers and computes in its ``compute_dtype`` (bf16 in QLoRA recipes), and
    integer weights without a declared compute dtype (LLM.int8, GPTQ, AWQ kernels) compute in half
    precision. Recomputing when unsure costs one forward pass; skipping it wrongly, a first ratio that is
    not 1.

    Args:
        accelerator: the trainer's; its ``mixed_precision`` is ``"no"``, ``"bf16"`` or ``"fp16"``.
        policy: the policy (any wrapper).

    Returns:
        True when some forward of the policy computes in less than float32.
    """
    if accelerator.mixed_precision != "no":
        return True
    return any(_computes_below_float32(module) for module in policy.modules())


def _computes_below_float32(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are used in less than float32 (see
    :func:`needs_teacher_forced_old_logprobs`)."""
    compute_dtype = getattr(module, "compute_dtype", None)  # bitsandbytes' Linear4bit
    if isinstance(compute_dtype, torch.dtype):
        return compute_dtype != torch.float32
    own = list(module.parameters(recurse=False))
    return any(not p.is_floating_point() or p.dtype != torch.float32 for p in own)


def clip_grad_norms(
    accelerator: Accelerator, parameter_groups: Iterable[list[nn.Parameter]], max_norm: float
) -> list[torch.Tensor | None]:
    """Clip each group's gradients to ``max_norm`` separately; return each group's norm before clipping.

    ``accelerator.clip_grad_norm_`` unscales the fp16 gradients of every optimizer on each call, and
    ``GradScaler.unscale_`` may run once per optimizer step ("unscale_() has already been called"), so
    here the gradients are unscaled once and each group is clipped by accelerate's DTensor-aware clipping
    (FSDP2 shards are DTensors: their norm is reduced over the mesh) where this accelerate has it, else by
    ``torch.nn.utils.clip_grad_norm_`` (which handles DTensors on one mesh). Under DeepSpeed the engine
    clips at its ``gradient_clipping``; accelerate then only reports the norm.

    Args:
        accelerator: the trainer's.
        parameter_groups: lists of parameters; empty lists are skipped (norm None).
        max_norm: the bound on each group's L2 norm.

    Returns:
        One norm (a scalar tensor, or None) per group.
    """
    groups = [list(group) for group in parameter_groups]
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return [accelerator.clip_grad_norm_(group, max_norm) if group else None for group in groups]
    accelerator.unscale_gradients()  # a no-op unless fp16 with a GradScaler
    clip = getattr(accelerator, "_clip_grad_norm_dtensor_aware", None) or torch.nn.utils.clip_grad_norm_
    return [clip(group, max_norm) if group else None for group in groups]
