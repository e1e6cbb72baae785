"""Set-up helpers for :class:`~trl_sae.SAEPPOTrainer` other than the models (those are in
:mod:`trl_sae.trainer.setup.models`): the Accelerator and DeepSpeed's clipping and batch sizes, prompt datasets,
the sampling ``GenerationConfig`` and the optimizer's parameter groups.

Plain functions of the config; the trainer's set-up phases (``_setup_accelerator``,
``_prepare_prompt_dataset``, ``_setup_generation``, ``create_optimizer``, ...) call them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import accelerate
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, compare_versions
from transformers.trainer_utils import enable_full_determinism, set_seed
from transformers.utils import logging as hf_logging

from trl_sae.trainer.config import SAEPPOConfig
from trl_sae.trainer.setup.precision import enable_cpu_fp16

__all__ = [
    "build_accelerator",
    "check_deepspeed_saving",
    "check_fsdp_version",
    "configure_deepspeed_batch_sizes",
    "configure_deepspeed_clipping",
    "deepspeed_batch_sizes",
    "deepspeed_gradient_clipping",
    "unsharded_fsdp_launch_warning",
]

logger = hf_logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------------
# Accelerator
# ----------------------------------------------------------------------------------------------------
def build_accelerator(args: SAEPPOConfig) -> Accelerator:
    """The Accelerator for ``args`` (DDP settings, mixed precision, CPU), after which the process's log level
    and seed are set as ``transformers.Trainer`` sets them."""
    ddp_kwargs: dict[str, Any] = {}
    if args.value_warmup_steps > 0 or args.value_pretrain_rollouts > 0:
        # Critic-only warm-up steps and value pretraining leave the policy's parameters unused in the backward.
        if args.ddp_find_unused_parameters is False:
            which = "value_warmup_steps" if args.value_warmup_steps > 0 else "value_pretrain_rollouts"
            raise ValueError(
                f"SAEPPOConfig.ddp_find_unused_parameters=False cannot work with {which} > 0: the "
                "critic-only steps leave the policy's parameters out of the backward pass. Leave it unset."
            )
        ddp_kwargs["find_unused_parameters"] = True
    elif args.ddp_find_unused_parameters is not None:
        ddp_kwargs["find_unused_parameters"] = args.ddp_find_unused_parameters
    for name, key in (
        ("ddp_bucket_cap_mb", "bucket_cap_mb"),
        ("ddp_broadcast_buffers", "broadcast_buffers"),
        ("ddp_static_graph", "static_graph"),
    ):
        if getattr(args, name) is not None:
            ddp_kwargs[key] = getattr(args, name)
    kwargs_handlers = [DistributedDataParallelKwargs(**ddp_kwargs)] if ddp_kwargs else []
    mixed_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        cpu=args.use_cpu,
        kwargs_handlers=kwargs_handlers,
    )
    check_fsdp_version(accelerator)
    enable_cpu_fp16(accelerator)  # accelerate would leave fp16 on CPU to run in float32
    # As transformers.Trainer: the process's log level, and full determinism when asked for.
    hf_logging.set_verbosity(args.get_process_log_level())
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        set_seed(args.seed)
    message = unsharded_fsdp_launch_warning(
        accelerator.num_processes, str(accelerator.distributed_type), _accelerate_launch_arguments()
    )
    if message is not None:
        logger.warning_once(message)
    return accelerator


def check_fsdp_version(accelerator: Accelerator) -> None:
    """Refuse FSDP1 (accelerate's default ``fsdp_version: 1``); nothing under FSDP2 or without FSDP.

    The trainer clips, saves and calls submodules the FSDP2 way: gradient norms of ``DTensor`` shards summed
    over the processes (FSDP1's flat shards would give each process its own local norm), the actor's and the
    critic's parameters clipped as two groups (FSDP1's root unit flattens the embeddings, the output head and
    the value head into one parameter that is in neither), full state dicts gathered on save, and the root's
    own weights gathered for generation and the reference pass (``fsdp2_root_unsharded``).
    """
    if str(accelerator.distributed_type).endswith("FSDP") and not getattr(accelerator, "is_fsdp2", False):
        raise ValueError(
            "SAEPPOTrainer supports FSDP2 only and this accelerate config selects FSDP1 (fsdp_version: 1, "
            "accelerate's default); set `fsdp_version: 2` under fsdp_config, as the shipped "
            "examples/accelerate_configs/fsdp2.yaml does."
        )


def _accelerate_launch_arguments() -> list[str] | None:
    """The arguments after ``accelerate launch`` of the command that started this process (its parent: the
    launcher runs the script, or torchrun's agent inside it), or None when it was not started that way."""
    try:
        import psutil  # an accelerate dependency

        command = psutil.Process(os.getpid()).parent().cmdline()
    except Exception:  # no parent, or a platform psutil cannot read
        return None
    for position, word in enumerate(command):
        direct = word == "accelerate.commands.launch"
        if direct or (word == "launch" and position > 0 and "accelerate" in command[position - 1]):
            return command[position + 1 :]
    return None


def unsharded_fsdp_launch_warning(
    num_processes: int, distributed_type: str, launch_arguments: list[str] | None
) -> str | None:
    """Why an ``accelerate launch`` that asks for FSDP is not sharding, or None when it is (or was not asked).

    accelerate asks for FSDP through ``ACCELERATE_USE_FSDP``, but ``--cpu`` starts ONE process (its simple
    launcher) whatever ``--num_processes`` says, without that variable and without a word; so the launcher's
    own arguments are read too (with accelerate's parser and config loader, as the launcher reads them).

    Args:
        num_processes: this run's processes.
        distributed_type: the Accelerator's ``distributed_type`` (``"FSDP"`` when it shards).
        launch_arguments: the arguments after ``accelerate launch`` (see :func:`_accelerate_launch_arguments`).
    """
    config_file = None
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    single_process_cpu = False
    if launch_arguments is not None:
        from accelerate.commands.config.config_args import load_config_from_file
        from accelerate.commands.launch import launch_command_parser

        try:
            launch = launch_command_parser().parse_args(launch_arguments)
            if launch.config_file is not None:
                config_file = launch.config_file
                asked = asked or load_config_from_file(config_file).distributed_type == "FSDP"
            asked = asked or launch.use_fsdp
            single_process_cpu = launch.cpu
        except (Exception, SystemExit):  # not a launch command accelerate itself would accept
            pass
    if not asked or (num_processes > 1 and distributed_type.endswith("FSDP")):
        return None
    config = config_file or "your_fsdp_config.yaml"
    command = (
        f"`accelerate launch --config_file {config} --num_processes 2 your_script.py ... "
        "--use_cpu true` (SAEPPOConfig.use_cpu makes each process a gloo CPU rank)"
    )
    if num_processes == 1:
        why = (
            "`accelerate launch --cpu` starts a single process whatever --num_processes says"
            if single_process_cpu
            else "the launch asked for one process"
        )
        return (
            f"The accelerate launch asks for FSDP but this run has ONE process ({why}), so nothing is sharded "
            f"and the whole model, gradients and optimizer state sit in one process. On GPUs set --num_processes "
            f"to the GPU count; on CPU run {command}."
        )
    return (
        f"The accelerate launch asks for FSDP but accelerate runs these {num_processes} processes as "
        f"{distributed_type.split('.')[-1]} (it selects FSDP only on GPU-like devices: {command} runs DDP on "
        "CPU), so every process holds the whole model; nothing is sharded."
    )


def deepspeed_gradient_clipping(configured: Any, max_grad_norm: float | None) -> float:
    """The ``gradient_clipping`` value to put in DeepSpeed's config so that ``max_grad_norm`` holds.

    DeepSpeed clips gradients inside its engine step, and accelerate's ``clip_grad_norm_`` does nothing under
    DeepSpeed, so the trainer's separate actor / critic clipping cannot run there: DeepSpeed clips ONE global
    norm over the actor's and the critic's gradients together.

    Args:
        configured: the DeepSpeed config's ``gradient_clipping`` (``"auto"`` or absent: take ``max_grad_norm``;
            a number must agree with it).
        max_grad_norm: ``SAEPPOConfig.max_grad_norm``; ``None`` or ``<= 0`` disables clipping (DeepSpeed's 0).
    """
    wanted = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else 0.0
    if configured is None or configured == "auto":
        return wanted
    if float(configured) != wanted:
        raise ValueError(
            f"The DeepSpeed config sets gradient_clipping={configured} but SAEPPOConfig.max_grad_norm={max_grad_norm}; "
            "set gradient_clipping to 'auto' (or leave it out) so it follows max_grad_norm, or make them equal."
        )
    return wanted


def configure_deepspeed_clipping(accelerator: Accelerator, max_grad_norm: float | None) -> None:
    """Make DeepSpeed clip at ``max_grad_norm`` (one global norm: see :func:`deepspeed_gradient_clipping`);
    nothing without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    config["gradient_clipping"] = deepspeed_gradient_clipping(config.get("gradient_clipping"), max_grad_norm)
    if config["gradient_clipping"] > 0:
        logger.warning(
            f"DeepSpeed clips gradients itself: max_grad_norm={config['gradient_clipping']} applies to one global "
            "norm over the actor and the critic together, not to each separately as without DeepSpeed."
        )


def check_deepspeed_saving(accelerator: Accelerator) -> None:
    """Refuse ZeRO-3 unless it gathers 16-bit weights on save; nothing without DeepSpeed or below ZeRO-3.

    ZeRO-3 shards every weight, so a loadable model (``from_pretrained``) is one state dict gathered from
    the shards, which DeepSpeed builds only with ``stage3_gather_16bit_weights_on_model_save``: without it
    the first checkpoint, or the final save, fails after training.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") not in (True, "true"):
        raise ValueError(
            "DeepSpeed ZeRO-3 saves no loadable model unless zero_optimization."
            "stage3_gather_16bit_weights_on_model_save is true; set `zero3_save_16bit_model: true` in the "
            "accelerate config (or the key in the DeepSpeed json)."
        )


def _accelerate_sets_deepspeed_boundary() -> bool:
    """Whether accelerate tells DeepSpeed at each backward whether it ends the accumulation (1.8 and later:
    ``set_gradient_accumulation_boundary(sync_gradients)``). Before 1.8 it calls ``engine.step()`` after
    every backward and DeepSpeed steps on its own count of ``gradient_accumulation_steps`` backwards."""
    return compare_versions("accelerate", ">=", "1.8.0")


def deepspeed_batch_sizes(config: Mapping[str, Any], args: SAEPPOConfig, world_size: int) -> dict[str, int]:
    """DeepSpeed's ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` for the trainer's
    update loop, checked against ``config`` (a DeepSpeed config).

    The trainer prepares no dataloader, so accelerate cannot fill these from one (it stops in ``prepare()``
    while ``train_micro_batch_size_per_gpu`` is ``"auto"``). The update takes ONE optimizer step per PPO
    mini-batch of ``per_device_train_batch_size x gradient_accumulation_steps / num_mini_batches`` rows per
    process:

    - fixed micro-batches: ``per_device_train_batch_size`` rows each, so ``gradient_accumulation_steps`` is
      the exact number of backward passes per step (the last micro-batch may be smaller), which is also
      what DeepSpeed steps on before accelerate 1.8 (see :func:`_accelerate_sets_deepspeed_boundary`);
    - ``max_tokens_per_microbatch``: the number of micro-batches varies between steps and processes (1 up to
      one per row), so no count is exact; the trainer declares one-row micro-batches, one per row. That is
      harmless and the safest choice: accelerate (1.8 and later) marks the step boundary itself at each
      backward, so DeepSpeed never steps on its own count; the trainer's ``_backward`` undoes DeepSpeed's
      division by the count, whatever it is (see :func:`configure_deepspeed_batch_sizes`); the step's
      ``train_batch_size`` is then exactly its rows (DeepSpeed's sample counter stays right); and the count
      is > 1 whenever a step can have several backwards, which DeepSpeed before 0.19 needs to accumulate
      CPU-offloaded ZeRO-1/2 gradients (with 1 it keeps only the last backward's).

    Args:
        config: the DeepSpeed config (``DeepSpeedPlugin.deepspeed_config``). A key that is ``"auto"`` or
            absent takes the trainer's value; an explicit one must agree, ``train_batch_size`` included
            (micro-batch x accumulation x ``world_size``). ``gradient_accumulation_steps=1`` counts as not
            given: accelerate writes 1 into a DeepSpeed json that has no such key, and ``accelerate config``
            proposes 1, so a 1 there cannot be told from "not set".
        args: the trainer's config (``per_device_train_batch_size``, ``gradient_accumulation_steps``,
            ``num_mini_batches``, ``max_tokens_per_microbatch``).
        world_size: the number of processes (DeepSpeed's data-parallel size).

    Returns:
        ``{"train_micro_batch_size_per_gpu": ..., "gradient_accumulation_steps": ...}``.

    Raises:
        ValueError: an explicit value that differs from the trainer's, or ``max_tokens_per_microbatch`` with
            an accelerate older than 1.8 (DeepSpeed would then step after a fixed count of backwards).
    """
    # SAEPPOConfig checks that num_mini_batches divides the rollout's rows.
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
    rows_per_step = rows // args.num_mini_batches
    if args.max_tokens_per_microbatch is None:
        micro = args.per_device_train_batch_size
        accumulation = math.ceil(rows_per_step / micro)  # torch.split's count of micro-batches
        how = f"micro-batches of per_device_train_batch_size={micro} rows"
    else:
        if not _accelerate_sets_deepspeed_boundary():
            raise ValueError(
                f"SAEPPOConfig.max_tokens_per_microbatch={args.max_tokens_per_microbatch} under DeepSpeed "
                f"needs accelerate >= 1.8 (installed: {accelerate.__version__}), which marks the optimizer "
                "step at each backward; upgrade accelerate or set max_tokens_per_microbatch=None."
            )
        micro, accumulation = 1, rows_per_step
        how = "max_tokens_per_microbatch (a varying number of micro-batches, counted as one row each)"
    wanted = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
    }
    for key, value in wanted.items():
        configured = config.get(key)
        accelerate_default = key == "gradient_accumulation_steps" and configured == 1
        if configured is None or configured == "auto" or accelerate_default:
            continue
        if configured != value:
            raise ValueError(
                f"The DeepSpeed config sets {key}={configured} but SAEPPOTrainer needs {key}={value} (one "
                f"optimizer step per PPO mini-batch of {rows_per_step} rows per process on {world_size} "
                f"process(es), {how}); set {key} to 'auto' (or leave it out) so the trainer fills it, and "
                "size batches with SAEPPOConfig's per_device_train_batch_size, gradient_accumulation_steps "
                "and num_mini_batches."
            )
    del wanted["train_batch_size"]  # see configure_deepspeed_batch_sizes
    return wanted


def configure_deepspeed_batch_sizes(accelerator: Accelerator, args: SAEPPOConfig) -> None:
    """Write :func:`deepspeed_batch_sizes` into DeepSpeed's config (before ``prepare``) and give the
    Accelerator the same ``gradient_accumulation_steps``; nothing without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    sizes = deepspeed_batch_sizes(config, args, accelerator.num_processes)
    config.update(sizes)
    # An "auto" train_batch_size is left out, so DeepSpeed derives it from the two above and its own
    # data-parallel size, always consistent; accelerate would fill it with its process count, which can
    # differ (1 on CPU ranks, where accelerate sets no backend; or with tensor parallelism).
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    # DeepSpeed divides every gradient by its gradient_accumulation_steps and the trainer's _backward
    # multiplies the loss by the Accelerator's to undo it (each micro-batch's loss is already its share of
    # the mini-batch's), so the two must agree. accelerate 1.8+ copies DeepSpeed's over in prepare (with a
    # mismatch warning); older versions do not, which would scale every step by the ratio.
    accelerator.gradient_accumulation_steps = sizes["gradient_accumulation_steps"]
