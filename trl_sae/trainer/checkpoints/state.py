"""What a checkpoint of SAEPPOTrainer is, and how it is saved and restored: explicit objects, not the trainer.

A checkpoint is :class:`CheckpointState`: the objects holding the training state a resumed run needs, each
saved to its own file of the ``checkpoint-<step>`` folder:

* ``accelerate_state/``: what the accelerator saves of the objects registered with it: the prepared model
  (policy and critic weights), the optimizer (e.g. Adam's moments), the learning-rate scheduler and every
  process's random number generators;
* ``trainer_state.json``: the progress: step, episode, epoch, log history and, with ``filter_groups``, where
  the prompt stream continues (:mod:`~trl_sae.trainer.objectives.dynamic_sampling`);
* ``training_args.json`` and ``model_setup.json``: the settings and the model set-up it was saved with,
  compared on resume (:mod:`~trl_sae.trainer.checkpoints.folders` holds the comparisons and refusals);
* the policy (and critic) loadable with ``from_pretrained``, written by a ``save_model`` callable so a
  trainer subclass's override is honoured.

:func:`save_checkpoint` stages the folder and publishes it with its manifest (a full disk is one
:class:`~trl_sae.trainer.checkpoints.folders.CheckpointDiskFullError`, the previous checkpoint kept);
:func:`load_checkpoint` refuses a checkpoint whose model set-up, fixed settings or prompt order differ, loads
the state into the given objects, restores the progress in place and re-plans the learning-rate schedule from
the current settings. :func:`save_model_files` and :func:`save_peft_policy` write the model (gathering a full state dict
first under FSDP2 and DeepSpeed). Every function is called on every process; the main process writes.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trl_sae.trainer.checkpoints.folders import (
    ACCELERATE_STATE_DIR,
    CHECKPOINT_PREFIX,
    MODEL_SETUP_FILE,
    SETTINGS_FILE,
    TRAIN_PROMPTS_KEY,
    TRAINER_STATE_FILE,
    CheckpointDiskFullError,
    disk_full_message,
    fixed_setting_changes,
    folder_bytes,
    is_disk_full,
    model_setup,
    model_setup_differences,
    plan_training_start,
    prompt_order_changes,
    publish_checkpoint,
    remove_checkpoints,
    settings_differences,
    trainer_checkpoint_files,
)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from trl_sae.trainer.config import SAEPPOConfig
    from trl_sae.trainer.trl_base import OnlineTrainerState

__all__ = [
    "CheckpointState",
    "FreshSchedule",
    "SaveFailedOnAnotherProcessError",
    "fresh_schedule",
    "load_checkpoint",
    "plan_start",
    "replan_schedule",
    "restore_progress",
    "save_checkpoint",
    "save_model_files",
    "save_peft_policy",
    "write_on_every_process",
]

logger = logging.getLogger(__name__)


@dataclass
class CheckpointState:
    """The objects a checkpoint saves and a resume restores (see the module doc for the file of each).

    Attributes:
        accelerator: saves and loads the objects registered with it (model, optimizer, learning-rate
            scheduler) and every process's random number generators.
        model: the prepared policy-and-critic wrapper; its set-up is saved and compared on resume.
        lr_scheduler: the learning-rate scheduler, with its optimizer: their hyperparameters and schedule are
            re-planned from ``settings`` on resume.
        progress: the trainer state (step, episode, epoch, log history, the prompt-stream position in its
            ``stateful_callbacks``); saved whole, restored in place.
        settings: the run's settings: ``output_dir``, saved with the checkpoint and compared on resume.
        train_prompts: the train dataset's length, which places a checkpoint in its epoch when a resume
            changes the data seed (None: every checkpoint counts as mid-epoch).
    """

    accelerator: Any
    model: nn.Module
    lr_scheduler: Any
    progress: OnlineTrainerState
    settings: SAEPPOConfig
    train_prompts: int | None = None


# ----------------------------------------------------------------------------------------------------
# Where a run starts
# ----------------------------------------------------------------------------------------------------
def plan_start(accelerator: Any, settings: SAEPPOConfig, resume: str | bool | None) -> str | None:
    """The checkpoint to resume from (None: fresh), after refusing or clearing old checkpoints.

    The main process verifies and deletes (see :func:`~trl_sae.trainer.checkpoints.folders.plan_training_start`)
    and broadcasts the outcome, so every process resumes from the same folder or raises the same error.
    """
    from accelerate.utils import broadcast_object_list

    outcome: list[Any] = [None, None]  # [checkpoint path, error message]
    if accelerator.is_main_process:
        try:
            plan = plan_training_start(settings.output_dir, resume, settings.overwrite_output_dir)
            remove_checkpoints(plan.remove)
            outcome = [None if plan.checkpoint is None else str(plan.checkpoint), None]
        except Exception as error:
            if accelerator.num_processes == 1:
                raise
            outcome = [None, str(error)]
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome)
        accelerator.wait_for_everyone()
    if outcome[1] is not None:
        raise ValueError(outcome[1])
    return outcome[0]


# ----------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------
def save_checkpoint(state: CheckpointState, save_model: Callable[[str], None]) -> str:
    """Save ``checkpoint-<step>``: staged in ``tmp-checkpoint-<step>``, then published with its manifest.
    Every process calls it; rotating older checkpoints is the caller's (after this returns).

    Args:
        state: what the checkpoint holds.
        save_model: writes the policy (and critic) into the folder it is given, on every process.

    Returns:
        The checkpoint's folder.

    Raises:
        CheckpointDiskFullError: the disk filled while saving; the staged folder is removed and the previous
            checkpoint kept (it is only ever replaced by renaming a complete one).
    """
    accelerator, settings = state.accelerator, state.settings
    name = f"{CHECKPOINT_PREFIX}-{state.progress.global_step}"
    final_dir = os.path.join(settings.output_dir, name)
    staging_dir = os.path.join(settings.output_dir, f"tmp-{name}")
    if accelerator.is_main_process and os.path.exists(staging_dir):
        shutil.rmtree(staging_dir)
    accelerator.wait_for_everyone()

    def publish() -> None:
        if accelerator.is_main_process:
            state.progress.save_to_json(os.path.join(staging_dir, TRAINER_STATE_FILE))
            # With the train dataset's length: the prompt order a resume continues is a shuffle of that many.
            saved_settings = {**settings.to_dict(), TRAIN_PROMPTS_KEY: state.train_prompts}
            _write_json(os.path.join(staging_dir, SETTINGS_FILE), saved_settings)
            _write_json(
                os.path.join(staging_dir, MODEL_SETUP_FILE),
                model_setup(accelerator.unwrap_model(state.model)),
            )
            publish_checkpoint(staging_dir, final_dir)

    try:
        save_model(staging_dir)
        # The agreement is also the barrier: every process's files (its random_states_<rank>.pkl) are on disk
        # before the manifest lists them.
        write_on_every_process(
            accelerator, lambda: accelerator.save_state(os.path.join(staging_dir, ACCELERATE_STATE_DIR)), name
        )
        write_on_every_process(accelerator, publish, name)
    except Exception as error:
        if not is_disk_full(error):
            raise
        staged = folder_bytes(staging_dir)
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise CheckpointDiskFullError(disk_full_message(settings.output_dir, name, staged)) from error
    return final_dir


def _write_json(path: str, content: Any) -> None:
    with open(path, "w") as handle:
        json.dump(content, handle, indent=2, default=str)


class SaveFailedOnAnotherProcessError(RuntimeError):
    """Another process's part of a save failed (its own error says why); this one stops too."""


def write_on_every_process(accelerator: Any, write: Callable[[], None], what: str) -> None:
    """Run ``write`` (this process's part of a save; often the main process writes and the others have
    nothing to do), then agree with every other process on whether all parts succeeded, in place of a barrier.

    A failed write used to end only its own process, while the others waited at the next barrier until the
    launcher or the collective timeout killed them. Now every process ends at once: the failing one with its
    own error, the others with :class:`SaveFailedOnAnotherProcessError` naming the failing rank. One
    all-gather of one number per process.
    """
    import torch

    error: Exception | None = None
    try:
        write()
    except Exception as caught:
        error = caught
    failing = [0] if error is not None else []
    if accelerator.num_processes > 1:
        flags = torch.tensor([float(error is not None)], device=accelerator.device)
        failing = [rank for rank, flag in enumerate(accelerator.gather(flags).tolist()) if flag]
    if error is not None:
        raise error
    if failing:
        raise SaveFailedOnAnotherProcessError(
            f"rank {failing[0]} failed to save, stopping (writing {what}; rank {failing[0]}'s own error says why)"
        )


def save_model_files(
    accelerator: Any,
    model: nn.Module,
    settings: SAEPPOConfig,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: str,
    save_peft: Callable[[nn.Module, str, dict[str, Any] | None], None] | None = None,
) -> None:
    """Save the policy (loadable with ``from_pretrained``), the tokenizer and the settings, and with
    ``save_value_model`` the critic in ``value_model/``. Every process calls it; when one process's writes
    fail, every process stops (:func:`write_on_every_process`).

    Args:
        model: the prepared policy-and-critic wrapper.
        save_peft: for a LoRA policy, writes it (main process) given the unwrapped wrapper, the folder and the
            gathered state dict (see :func:`save_peft_policy`); None for a full policy.
    """
    # FSDP2 and DeepSpeed hold the weights in their own engines (FSDP2 and ZeRO-3 shard them): gather one
    # full state dict of the whole wrapper, a collective every rank joins (the main process receives it on
    # CPU), and save the policy and critic from it. accelerate < 1.6 (the declared floor is 1.4) has no FSDP2
    # and no `is_fsdp2`.
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
    gather = getattr(accelerator, "is_fsdp2", False) or deepspeed
    full_state = accelerator.get_state_dict(model) if gather else None

    def write() -> None:
        from trl_sae.trainer.setup.adapters import sub_state_dict

        unwrapped = accelerator.unwrap_model(model)
        if save_peft is not None:
            if accelerator.is_main_process:
                save_peft(unwrapped, output_dir, full_state)
        else:
            policy_state = sub_state_dict(full_state, "policy.")
            _write_pretrained(unwrapped.policy, output_dir, settings, tokenizer, policy_state)
        if settings.save_value_model and unwrapped.has_critic and accelerator.is_main_process:
            unwrapped.save_critic(os.path.join(output_dir, "value_model"), state_dict=full_state)

    write_on_every_process(accelerator, write, os.path.basename(os.path.normpath(output_dir)))


def _write_pretrained(
    policy: nn.Module,
    output_dir: str,
    settings: SAEPPOConfig,
    tokenizer: PreTrainedTokenizerBase,
    state_dict: dict[str, Any] | None,
) -> None:
    """What ``transformers.Trainer._save`` writes for a ``PreTrainedModel`` on the processes that save
    (``should_save``): the model, the tokenizer and the settings (``training_args.bin``)."""
    import torch
    from transformers.trainer import TRAINING_ARGS_NAME

    if not settings.should_save:
        return
    os.makedirs(output_dir, exist_ok=True)
    policy.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
    tokenizer.save_pretrained(output_dir)
    torch.save(settings, os.path.join(output_dir, TRAINING_ARGS_NAME))


@contextmanager
def _without_zero3_init(accelerator: Any) -> Iterator[None]:
    """Models built inside are plain ones. Under ZeRO-3 transformers builds every model inside DeepSpeed's
    ``zero.Init`` (partitioned at construction: a collective of all processes) while accelerate's DeepSpeed
    config is registered with it, which accelerate does whatever ``zero3_init_flag`` says; so the registration
    is lifted for the block and then restored."""
    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if getattr(plugin, "dschf", None) is not None:
            set_hf_deepspeed_config(plugin.dschf)


def save_peft_policy(
    accelerator: Any,
    unwrapped: nn.Module,
    output_dir: str,
    tokenizer: PreTrainedTokenizerBase,
    merge: bool,
    full_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save a LoRA policy as its adapter (or merged into a full model when ``merge``: ``merge_adapters``) and
    the tokenizer; ``full_state`` (the wrapper's gathered keys, FSDP2/DeepSpeed) replaces the module's weights."""
    from trl_sae.gguf import peft_save_kwargs
    from trl_sae.trainer.setup.adapters import merge_adapter_into_full_model, sub_state_dict

    policy = unwrapped.policy
    adapter = getattr(unwrapped, "policy_adapter", policy.active_adapter)
    os.makedirs(output_dir, exist_ok=True)
    if merge:
        # Under ZeRO-3/FSDP2 the local weights are shards: merge the gathered ones. The merged model is built
        # whole on this process alone, never under DeepSpeed's zero.Init (a collective the others are not in).
        policy_state = sub_state_dict(full_state, "policy.")
        with _without_zero3_init(accelerator):
            merged = merge_adapter_into_full_model(policy, adapter, state_dict=policy_state)
        merged.save_pretrained(output_dir)
    elif full_state is not None:
        policy.save_pretrained(
            output_dir,
            selected_adapters=[adapter],
            state_dict=sub_state_dict(full_state, "policy."),
            **peft_save_kwargs(policy),
        )
    else:
        policy.save_pretrained(output_dir, selected_adapters=[adapter], **peft_save_kwargs(policy))
    tokenizer.save_pretrained(output_dir)


# ----------------------------------------------------------------------------------------------------
# Resuming
# ----------------------------------------------------------------------------------------------------
def _read_json(path: str) -> dict[str, Any] | None:
    """A checkpoint's JSON file, or None when it has none (saved by an older trl-sae)."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


@dataclass
class FreshSchedule:
    """What a new run's optimizer and scheduler start with, taken before a checkpoint's state replaces it:
    each parameter group's hyperparameters (``lr``, ``initial_lr``, ``betas``, ``eps``, ``weight_decay``,
    ...: everything but ``params``) and the scheduler's state at step 0."""

    groups: list[dict[str, Any]]
    scheduler: dict[str, Any]


def fresh_schedule(lr_scheduler: Any) -> FreshSchedule:
    """The current settings' optimizer hyperparameters and step-0 schedule (call it before loading a state)."""
    optimizer = lr_scheduler.optimizer
    groups = [
        {k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    ]
    return FreshSchedule(groups, copy.deepcopy(lr_scheduler.state_dict()))


def replan_schedule(lr_scheduler: Any, fresh: FreshSchedule, step: int) -> None:
    """Make the optimizer's hyperparameters and the learning-rate schedule those of the current settings, at
    ``step``: as if this run had been planned with them (``learning_rate``, ``critic_learning_rate``, Adam's
    betas and eps, ``weight_decay``, ``lr_scheduler_type``/``_kwargs``, ``warmup_steps`` and the number of
    steps) from its start.

    A checkpoint's optimizer state holds the learning rate of its last step and its scheduler state the
    base rates it was built with, so loading them alone would train on at the old rates (or at 0, after a
    linear decay to the old ``max_steps``) whatever the current settings say. The optimizer's moments are
    kept: only its hyperparameters are set. The scheduler is rewound to its step-0 state and stepped
    ``step`` times, which gives every scheduler, closed-form or chained, the rate it has at ``step``.
    """
    scheduler = lr_scheduler
    groups = scheduler.optimizer.param_groups
    if len(groups) != len(fresh.groups):
        raise ValueError(
            f"resume_from_checkpoint: the checkpoint's optimizer has {len(groups)} parameter groups and this "
            f"run's {len(fresh.groups)}; resume with the settings it was saved with, or start a fresh run."
        )
    for group, hyperparameters in zip(groups, fresh.groups, strict=True):
        group.update(copy.deepcopy(hyperparameters))
    scheduler.load_state_dict(copy.deepcopy(fresh.scheduler))
    with warnings.catch_warnings():
        # torch warns when a scheduler steps before the optimizer: here it only replays the schedule.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step):
            scheduler.step()


def _group_lrs(lr_scheduler: Any) -> list[float]:
    return [float(group["lr"]) for group in lr_scheduler.optimizer.param_groups]


def _schedule_note(before: list[float], after: list[float], step: int, total: int) -> str | None:
    """A few words when re-planning changed the learning rates of the resumed step; None otherwise."""
    if all(math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) for a, b in zip(before, after, strict=True)):
        return None
    shown = sorted(set(zip(before, after, strict=True)), key=lambda pair: -pair[1])
    rates = ", ".join(f"{a:.6g} -> {b:.6g}" for a, b in shown)
    return (
        f"the learning-rate schedule is re-planned from the current settings over {total} steps, so step "
        f"{step + 1} trains at lr {rates} (the checkpoint's -> the current settings')"
    )


def load_checkpoint(state: CheckpointState, checkpoint: str) -> None:
    """Load a checkpoint that :func:`plan_start` chose and verified against its manifest into ``state``'s
    objects, and restore its progress into ``state.progress`` in place.

    Before any weight is read: a model set-up the weights cannot load into (or would compute another
    function with: LoRA's alpha) is one ValueError naming each difference, and so is a change of a setting
    the checkpoint's state fixes (``checkpointing.fixed_setting_changes``). Then the state is loaded, the
    optimizer's hyperparameters and the learning-rate schedule are re-planned from the current settings
    (:func:`replan_schedule`), and the other differences of set-up or settings are one warning (main
    process): the run continues with the current ones.
    """
    from trl_sae.trainer.objectives.dynamic_sampling import prompt_stream_position
    from trl_sae.trainer.trl_base import OnlineTrainerState

    state_dir, state_file = trainer_checkpoint_files(checkpoint)
    saved = OnlineTrainerState.load_from_json(state_file)
    differences = _refuse_fixed_changes(state, checkpoint, prompt_stream_position(saved))
    fresh = fresh_schedule(state.lr_scheduler)
    _load_accelerate_state(state.accelerator, state_dir, checkpoint)
    restore_progress(state.progress, saved)
    restored = _group_lrs(state.lr_scheduler)
    replan_schedule(state.lr_scheduler, fresh, saved.global_step)
    note = _schedule_note(
        restored, _group_lrs(state.lr_scheduler), saved.global_step, state.settings.num_total_batches
    )
    if state.accelerator.is_main_process and (differences or note):
        differ = (
            f" with settings that differ from the ones it was saved with: {'; '.join(differences)} (this run "
            "continues with the current ones)"
            if differences
            else ""
        )
        logger.warning("resuming from %s%s%s.", checkpoint, differ, f"; {note}" if note else "")


def restore_progress(progress: OnlineTrainerState, saved: OnlineTrainerState) -> None:
    """Continue ``progress`` where ``saved`` (a checkpoint's trainer state) stopped: step, episode, epoch, log
    history and, with ``filter_groups``, the prompt-stream position."""
    from trl_sae.trainer.objectives.dynamic_sampling import restore_prompt_stream

    progress.global_step = saved.global_step
    progress.episode = saved.episode
    progress.epoch = saved.epoch
    progress.log_history = saved.log_history
    restore_prompt_stream(progress, saved)  # filter_groups: where the prompt order continues


def _refuse_fixed_changes(state: CheckpointState, checkpoint: str, position: int) -> list[str]:
    """Raise when the model set-up or a setting the checkpoint fixes differs (the prompt order too, the
    checkpoint standing ``position`` prompt batches into it); the other differences."""
    differences: list[str] = []
    saved_setup = _read_json(os.path.join(checkpoint, MODEL_SETUP_FILE))
    if saved_setup is not None:
        current_setup = model_setup(state.accelerator.unwrap_model(state.model))
        blocking, loadable = model_setup_differences(saved_setup, current_setup)
        if blocking:
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} was saved with another model set-up, which its weights "
                f"cannot load into or would compute another function with: {'; '.join(blocking)}. Resume with "
                "the model, LoRA and critic settings it was saved with, or start a fresh run."
            )
        differences += loadable
    saved_settings = _read_json(os.path.join(checkpoint, SETTINGS_FILE))
    if saved_settings is not None:
        saved_prompts = saved_settings.pop(
            TRAIN_PROMPTS_KEY, None
        )  # absent from checkpoints before it was saved
        current = state.settings.to_dict()
        fixed = fixed_setting_changes(saved_settings, current)
        fixed += prompt_order_changes(saved_settings, current, position, state.train_prompts, saved_prompts)
        if fixed:
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} was saved with settings a resumed run cannot change: "
                f"{'; '.join(fixed)}. Resume with the values it was saved with, or start a fresh run."
            )
        differences += settings_differences(saved_settings, current)
    return differences


def _load_accelerate_state(accelerator: Any, state_dir: str, checkpoint: str) -> None:
    """``accelerator.load_state``, with weights that do not fit this model as one line naming the fix."""
    try:
        accelerator.load_state(state_dir)
    except RuntimeError as error:
        # A checkpoint without a model_setup.json (saved before it existed) whose weights do not fit.
        if "Error(s) in loading state_dict" not in str(error):
            raise
        lines = str(error).splitlines()
        first = (lines[1] if len(lines) > 1 else lines[0]).strip()
        first = first if len(first) <= 240 else first[:240] + " ..."
        raise ValueError(
            f"resume_from_checkpoint: the weights in {checkpoint} do not fit this model ({first}); resume with "
            "the model, LoRA and critic settings it was saved with, or start a fresh run."
        ) from error
