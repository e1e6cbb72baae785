"""Everything :class:`~trl_sae.SAEPPOTrainer` does for vLLM rollouts besides calling the engine.

The engine itself is :class:`trl_sae.generation.vllm_backend.VLLMRollout`; this module checks that a run can
use it (early, in ``__init__``), builds it from the config, and measures how far vLLM's log-probabilities are
from the trainer's (the ``rollout/*`` metrics). See docs/design.md, "vLLM rollouts".
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

import torch
from accelerate.utils import DistributedType

from trl_sae.core.segmentation import probability_boundaries
from trl_sae.generation.vllm_backend import VLLMRollout, is_vllm_available
from trl_sae.trainer.setup.adapters import base_model, merged_adapter_weights

__all__ = [
    "build_vllm_rollout",
    "check_vllm_setup",
    "engine_kv_cache_bytes",
    "engine_max_model_length",
    "longest_prompt_length",
    "rollout_mismatch_stats",
    "vllm_sampling_seed",
]


def check_vllm_setup(args: Any, accelerator: Any, is_peft_model: bool) -> None:
    """Refuse, with one line naming the setting, what the vLLM path cannot do on this run."""
    if not is_vllm_available():
        raise ImportError(
            'SAEPPOConfig.use_vllm=True needs vLLM: pip install "trl-sae[vllm]" (CPU-only machines: see '
            "docs/guides/vllm.md, 'vLLM on a CPU'), or set use_vllm=False."
        )
    on_cuda = accelerator.device.type == "cuda"
    if args.vllm_mode == "server" and not on_cuda:
        raise ValueError(
            "SAEPPOConfig.vllm_mode='server' pushes the policy's weights to the server over NCCL, which needs a "
            f"CUDA device (this run is on {accelerator.device.type!r}); use vllm_mode='colocate'."
        )
    if args.vllm_enable_sleep_mode and not on_cuda:
        raise ValueError(
            "SAEPPOConfig.vllm_enable_sleep_mode=True frees CUDA memory between rollouts; this run is on "
            f"{accelerator.device.type!r}, so set it to False."
        )
    if is_peft_model and accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError(
            "SAEPPOConfig.use_vllm=True with a LoRA policy under FSDP is not supported: the merged weights "
            "would be built from sharded parameters. Use DDP or DeepSpeed ZeRO for LoRA + vLLM, or full "
            "fine-tuning under FSDP."
        )
    if args.load_in_4bit and args.vllm_mode == "server":
        # The engine receives merged full-precision weights; a server started from the 4-bit checkpoint
        # would expect quantized ones.
        raise ValueError(
            "SAEPPOConfig.load_in_4bit=True with vllm_mode='server' is not supported: the trainer pushes merged "
            "bf16 weights, which a server must be started unquantized to accept. Use vllm_mode='colocate'."
        )


def _engine_dtype(args: Any, policy: torch.nn.Module) -> str:
    """The engine's dtype: the training precision (bf16/fp16 mixed precision) or the policy's own."""
    if args.bf16:
        return "bfloat16"
    if args.fp16:
        return "float16"
    embeddings = policy.get_input_embeddings()
    return str(embeddings.weight.dtype).removeprefix("torch.")


def _model_position_limit(config: Any) -> int | None:
    """The longest sequence the model's config allows (``max_position_embeddings``), or None when it is unknown
    or stretched by RoPE scaling (vLLM computes that limit itself and reports it)."""
    limit = getattr(config, "max_position_embeddings", None)
    for name in ("rope_scaling", "rope_parameters"):
        scaling = getattr(config, name, None)
        if isinstance(scaling, dict) and scaling.get("factor") not in (None, 1, 1.0):
            return None
    return limit


def longest_prompt_length(datasets: Iterable[Any]) -> int:
    """The longest tokenised prompt (``input_ids``) over ``datasets`` (None entries skipped); 0 if empty."""
    return max(
        (len(ids) for dataset in datasets if dataset is not None for ids in dataset["input_ids"]), default=0
    )


def engine_max_model_length(args: Any, model_config: Any, longest_prompt: int) -> int | None:
    """The colocated engine's context length: room for every prompt the run can hold plus ``response_length``,
    within what the model allows. Refuses, with one line naming the settings, a length that would make vLLM cut
    completions short (it silently truncates a row whose prompt + ``max_tokens`` exceeds the context) or one the
    model cannot hold (vLLM's own error is a long validation traceback after the engine starts).

    Args:
        args: the ``SAEPPOConfig``.
        model_config: the policy's (base model's) config.
        longest_prompt: the longest prompt of the train and eval datasets, in tokens (after ``overlong_prompts``).

    Returns:
        ``vllm_max_model_length`` if set; else ``max_prompt_length + response_length``, lowered to the model's
        ``max_position_embeddings`` when the datasets' prompts still fit; None leaves it to vLLM (no limit known).
    """
    response = args.response_length
    needed = longest_prompt + response
    model_limit = _model_position_limit(model_config)
    configured = args.vllm_max_model_length
    if configured is not None:
        if model_limit is not None and configured > model_limit:
            raise ValueError(
                f"SAEPPOConfig.vllm_max_model_length={configured} exceeds the model's max_position_embeddings="
                f"{model_limit}; set vllm_max_model_length <= {model_limit} (or leave it None)."
            )
        if configured < needed:
            raise ValueError(
                f"SAEPPOConfig.vllm_max_model_length={configured} cannot hold the longest prompt ({longest_prompt} "
                f"tokens) + response_length={response}, so vLLM would cut completions short; set "
                f"vllm_max_model_length >= {needed} or a max_prompt_length that leaves room."
            )
        return configured
    if model_limit is not None and needed > model_limit:
        raise ValueError(
            f"The longest prompt ({longest_prompt} tokens) + SAEPPOConfig.response_length={response} = {needed} "
            f"tokens exceed the model's max_position_embeddings={model_limit}; lower response_length or set "
            f"max_prompt_length <= {model_limit - response} (overlong_prompts decides what happens to longer ones)."
        )
    wanted = args.max_prompt_length + response if args.max_prompt_length is not None else model_limit
    if wanted is None:
        return None
    # max_prompt_length is an upper bound: the datasets' prompts fit the model, so the engine gets all it allows.
    return min(wanted, model_limit) if model_limit is not None else wanted


def engine_kv_cache_bytes(args: Any, device_type: str) -> int | None:
    """``vllm_kv_cache_gib`` in bytes for vLLM's ``kv_cache_memory_bytes`` (None: vLLM's own sizing).

    vLLM's CPU platform replaces ``kv_cache_memory_bytes`` with ``VLLM_CPU_KVCACHE_SPACE`` when that variable is
    set, so on CPU the two must agree: a different value is refused rather than silently overridden.
    """
    if args.vllm_kv_cache_gib is None:
        return None
    size = int(args.vllm_kv_cache_gib * 2**30)
    variable = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if device_type == "cpu" and variable != "" and int(variable) * 2**30 != size:
        raise ValueError(
            f"SAEPPOConfig.vllm_kv_cache_gib={args.vllm_kv_cache_gib:g} but the environment sets "
            f"VLLM_CPU_KVCACHE_SPACE={variable}, which vLLM's CPU backend obeys instead; unset the variable or "
            "drop vllm_kv_cache_gib."
        )
    return size


def build_vllm_rollout(
    args: Any,
    accelerator: Any,
    policy: torch.nn.Module,
    tokenizer: Any,
    stop_token_ids: list[int],
    policy_adapter: str | None,
    longest_prompt: int,
) -> VLLMRollout:
    """The engine for this run, following ``policy`` (a LoRA policy through ``policy_adapter``'s merged
    weights: never the critic's adapter or value head). ``longest_prompt`` (tokens) sizes a colocated engine's
    context; an impossible size is refused here, before the engine starts."""
    named_weights = None
    if policy_adapter is not None:

        def named_weights() -> Any:
            return merged_adapter_weights(policy, policy_adapter)

    base = base_model(policy)
    kv_cache_memory_bytes = engine_kv_cache_bytes(args, accelerator.device.type)
    max_model_length = (
        engine_max_model_length(args, base.config, longest_prompt) if args.vllm_mode == "colocate" else None
    )
    return VLLMRollout(
        policy,
        accelerator,
        tokenizer,
        mode=args.vllm_mode,
        temperature=args.temperature,
        max_completion_length=args.response_length,
        stop_token_ids=stop_token_ids,
        named_weights=named_weights,
        dtype=_engine_dtype(args, policy),
        seed=args.seed,
        server_base_url=args.vllm_server_base_url,
        server_host=args.vllm_server_host,
        server_port=args.vllm_server_port,
        server_timeout=args.vllm_server_timeout,
        group_port=args.vllm_group_port,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=max_model_length,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        model_impl=args.vllm_model_impl,
    )


def vllm_sampling_seed(seed: int, step: int, process_index: int, stream: str = "train", call: int = 0) -> int:
    """The base seed of one vLLM sampling call; row ``r`` of the call samples with ``base + r``
    (:meth:`~trl_sae.generation.vllm_backend.VLLMRollout.generate`).

    A hash of (run seed, stream, step, process, call), so a resumed run samples what the uninterrupted one did,
    while processes, steps, the evaluation stream (``stream="eval"``, ``call`` = its batch index) and training
    never share noise: their ranges of ``B`` row seeds overlap with probability about ``2B / 2**31``. A linear
    formula would make ranges collide systematically (process 1's base = process 0's + a constant).

    Returns:
        An int in ``[0, 2**31)``.
    """
    key = f"trl-sae/vllm/{seed}/{stream}/{step}/{process_index}/{call}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2**31


@torch.no_grad()
def rollout_mismatch_stats(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    segment_threshold: float,
    importance_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's on the same tokens (this process's rows).

    Args:
        trainer_logprobs, sampler_logprobs: ``(B, T)`` log-probs of the sampled tokens.
        mask: ``(B, T)`` bool, valid tokens.
        segment_threshold: SAE's ``p``: a token is a probability-segmentation boundary where ``prob < p``.
        importance_weights: ``(B, T)`` the correction's weights, if applied.

    Returns:
        Sums and counts (so processes can be combined exactly): ``abs_diff_sum``, ``abs_diff_max``,
        ``tokens``, ``boundary_flips`` (tokens that are a boundary under one source and not the other),
        ``boundaries_trainer``, ``completions``; with weights, ``is_weight_sum`` and ``is_zero_tokens``
        (tokens whose weight is 0, i.e. masked out by a ``*_mask`` mode).
    """
    mask = mask.bool()
    diff = (trainer_logprobs - sampler_logprobs).abs()
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    trainer_boundary = probability_boundaries(trainer_logprobs, mask, segment_threshold)
    sampler_boundary = probability_boundaries(sampler_logprobs, mask, segment_threshold)
    stats = {
        "abs_diff_sum": diff.sum().double(),
        "abs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
        "tokens": mask.sum().double(),
        "boundary_flips": (trainer_boundary != sampler_boundary).sum().double(),
        "boundaries_trainer": trainer_boundary.sum().double(),
        "completions": torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device),
    }
    if importance_weights is not None:
        stats["is_weight_sum"] = torch.where(mask, importance_weights, 0.0).sum().double()
        stats["is_zero_tokens"] = ((importance_weights == 0) & mask).sum().double()
    return stats
