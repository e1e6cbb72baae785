"""Checkpoint manifests, verification, and what a run may do with the checkpoints in its ``output_dir``.

Every checkpoint folder ends with a manifest, :data:`MANIFEST_NAME`, written last (inside the staging
folder, before it is renamed into place): the relative path, size in bytes and SHA-256 of each file. A
folder whose files still match its manifest is *intact*; anything else (no manifest, a file missing,
truncated or changed) is *damaged* and is never resumed from.

:func:`plan_training_start` decides, before the first step, which checkpoint a run resumes from and which
old checkpoint folders it replaces:

* a fresh run into an ``output_dir`` that holds ``checkpoint-*`` folders is refused, unless
  ``overwrite_output_dir`` (then they are all deleted before the first step, so checkpoints of two runs
  never mix in rotation or in a later resume);
* ``resume_from_checkpoint=True`` verifies the checkpoints newest first, skips damaged ones with a warning
  naming the problem, resumes from the newest intact one, and deletes the damaged ones it skipped (the run
  re-creates those steps);
* an explicit checkpoint path must be intact (else a one-line :class:`DamagedCheckpointError`); checkpoints
  in ``output_dir`` from later steps belong to a future the run abandons, so resuming there is refused
  unless ``overwrite_output_dir`` (then they are deleted before the first step).

The manifest and planning functions are standard library only; the trainer runs them on the main process
and shares the outcome with the others.

The second half is the trainer's save and resume, which ``SAEPPOTrainer`` reaches through thin overridable
methods (``_save_checkpoint``, ``save_model``, ``_plan_start``, ``_resume``, ...):

* :func:`save_trainer_checkpoint` stages a checkpoint and publishes it; a full disk is one
  :class:`CheckpointDiskFullError` naming the folder, the free space and the checkpoint's size, with the
  staged part removed and the previous checkpoint untouched;
* :func:`save_trainer_model` saves the policy (and critic) loadable with ``from_pretrained``, gathering a
  full state dict first under FSDP2 and DeepSpeed (ZeRO-3 shards every weight);
* :func:`load_trainer_checkpoint` refuses, in one line, a checkpoint whose model or LoRA set-up differs in a
  way its weights cannot load into or would compute another function with (:data:`MODEL_SETUP_FILE`), or
  whose settings differ in one its state fixes (the optimizer, the seed, fp16); it re-plans the optimizer's
  hyperparameters and the learning-rate schedule from the current settings (:func:`replan_schedule`), and
  warns once about the settings that differ from the ones it was saved with (:data:`SETTINGS_FILE`).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trl_sae.trainer.sae_ppo_trainer import SAEPPOTrainer

__all__ = [
    "ACCELERATE_STATE_DIR",
    "CHECKPOINT_PREFIX",
    "MANIFEST_NAME",
    "MODEL_SETUP_FILE",
    "SETTINGS_FILE",
    "TRAINER_STATE_FILE",
    "CheckpointDiskFullError",
    "DamagedCheckpointError",
    "FreshSchedule",
    "SaveFailedOnAnotherProcessError",
    "StartPlan",
    "check_fresh_start",
    "checkpoint_problems",
    "checkpoint_step",
    "disk_full_message",
    "fixed_setting_changes",
    "folder_bytes",
    "fresh_schedule",
    "is_disk_full",
    "load_trainer_checkpoint",
    "model_setup",
    "model_setup_differences",
    "parse_resume_flag",
    "plan_trainer_start",
    "plan_training_start",
    "publish_checkpoint",
    "remove_checkpoints",
    "replan_schedule",
    "rotate_checkpoints",
    "save_peft_policy",
    "save_trainer_checkpoint",
    "save_trainer_model",
    "settings_differences",
    "sorted_checkpoints",
    "trainer_checkpoint_files",
    "verify_checkpoint",
    "write_manifest",
    "write_on_every_process",
]

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"
MANIFEST_NAME = "checkpoint_manifest.json"
_MANIFEST_VERSION = 1
_TRAINER_STATE_FILE = "trainer_state.json"


class DamagedCheckpointError(ValueError):
    """A checkpoint whose files do not match its manifest; the message names the folder and the file."""

    def __init__(self, checkpoint: str | os.PathLike, problems: list[str]) -> None:
        self.checkpoint = str(checkpoint)
        self.problems = list(problems)
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        super().__init__(f"checkpoint {self.checkpoint} is damaged: {problems[0]}{more}.")


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _sha256_all(paths: list[Path]) -> list[str]:
    """SHA-256 of each file, several files at a time (hashlib releases the GIL while it hashes)."""
    workers = max(1, min(8, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_sha256, paths))


def _files_of(folder: Path) -> list[Path]:
    """Every regular file under ``folder`` except the manifest (and its temporary), sorted."""
    skip = {MANIFEST_NAME, MANIFEST_NAME + ".tmp"}
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in skip
    )


def write_manifest(folder: str | os.PathLike) -> Path:
    """Write ``folder/checkpoint_manifest.json`` listing size and SHA-256 of every file under ``folder``.

    Call it after every other file of the checkpoint is written: its presence is what marks the checkpoint
    complete. It is written to a temporary name and renamed, so a crash never leaves half a manifest.

    Returns:
        The manifest's path.
    """
    folder = Path(folder)
    paths = _files_of(folder)
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": digest}
        for path, digest in zip(paths, _sha256_all(paths), strict=True)
    }
    manifest = folder / MANIFEST_NAME
    temporary = folder / (MANIFEST_NAME + ".tmp")
    with open(temporary, "w") as handle:
        json.dump({"version": _MANIFEST_VERSION, "algorithm": "sha256", "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, manifest)
    return manifest


def checkpoint_problems(folder: str | os.PathLike) -> list[str]:
    """What is wrong with a checkpoint folder, compared with its manifest; empty when it is intact.

    Sizes are checked for every file first (cheap), and checksums only when all sizes match, so a
    truncated multi-gigabyte file is found without reading it.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"no {MANIFEST_NAME} (an interrupted copy, or saved by a trl-sae without manifests)"]
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not all(
            isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in entries.values()
        ):
            raise ValueError("unknown manifest layout")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return [f"{MANIFEST_NAME} is unreadable ({error})"]
    problems = []
    for name, entry in entries.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} is {path.stat().st_size} bytes, the manifest says {entry['size']}")
    if problems:
        return problems
    digests = _sha256_all([folder / name for name in entries])
    for (name, entry), digest in zip(entries.items(), digests, strict=True):
        if digest != entry["sha256"]:
            return [
                f"{name} does not match its SHA-256 in the manifest (its contents changed after the save)"
            ]
    return []


def verify_checkpoint(folder: str | os.PathLike) -> None:
    """Raise :class:`DamagedCheckpointError` unless ``folder`` matches its manifest."""
    problems = checkpoint_problems(folder)
    if problems:
        raise DamagedCheckpointError(folder, problems)


def sorted_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-<step>`` folders of ``output_dir``, oldest step first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [
        p for p in folder.glob(f"{CHECKPOINT_PREFIX}-*") if re.fullmatch(rf"{CHECKPOINT_PREFIX}-\d+", p.name)
    ]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a checkpoint: from its ``checkpoint-<step>`` name, else from its trainer_state.json."""
    path = Path(path)
    match = re.fullmatch(rf"{CHECKPOINT_PREFIX}-(\d+)", path.name)
    if match:
        return int(match.group(1))
    return int(json.loads((path / _TRAINER_STATE_FILE).read_text())["global_step"])


def parse_resume_flag(value: str | bool | os.PathLike | None) -> str | bool | None:
    """``resume_from_checkpoint`` as the trainer reads it: ``True`` (latest), a path, or ``None`` (fresh).

    ``TrainingArguments`` parses the field as a string, so ``"true"``/``"false"`` (any case) mean the
    booleans, as transformers users expect from ``--resume_from_checkpoint true``; ``""`` means fresh.
    """
    if value is None or value is False:
        return None
    if value is True:
        return True
    text = os.fspath(value)
    if text.strip().lower() in ("", "false"):
        return None
    if text.strip().lower() == "true":
        return True
    return text


def check_fresh_start(output_dir: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse a fresh run into an ``output_dir`` holding checkpoints, unless ``overwrite``; cheap (no reads).

    :func:`plan_training_start` calls it; recipes call it too, before loading any model.
    """
    existing = sorted_checkpoints(output_dir)
    if existing and not overwrite:
        raise ValueError(
            f"output_dir {output_dir} already holds {_names(existing)} from an earlier run, which a fresh "
            "run would write over: continue it with --resume_from_checkpoint true, or start over with "
            "--overwrite_output_dir true (deletes them)."
        )


@dataclass
class StartPlan:
    """How a run starts: the checkpoint to load (``None``: fresh) and the old checkpoints it deletes first."""

    checkpoint: Path | None
    remove: list[Path] = field(default_factory=list)


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths)


def plan_training_start(
    output_dir: str | os.PathLike, resume: str | bool | None, overwrite: bool = False
) -> StartPlan:
    """Decide which checkpoint a run resumes from and which old ones it replaces (see the module doc).

    Args:
        output_dir: where the run writes its ``checkpoint-<step>`` folders.
        resume: the output of :func:`parse_resume_flag`.
        overwrite: ``overwrite_output_dir``: allow replacing checkpoints that are not this run's past.

    Raises:
        ValueError: one line naming the argument and the fix (a :class:`DamagedCheckpointError` for a
            damaged explicit checkpoint).
    """
    existing = sorted_checkpoints(output_dir)
    if resume is None:
        check_fresh_start(output_dir, overwrite)
        if existing:
            logger.warning(
                "overwrite_output_dir: deleting %s of an earlier run in %s.", _names(existing), output_dir
            )
        staging = [p for p in Path(output_dir).glob(f"tmp-{CHECKPOINT_PREFIX}-*") if p.is_dir()]
        return StartPlan(None, existing + staging)
    if resume is True:
        if not existing:
            raise ValueError(
                f"resume_from_checkpoint=True but output_dir {output_dir} has no {CHECKPOINT_PREFIX}-* folder; "
                "drop it to start a fresh run."
            )
        damaged: list[Path] = []
        reasons: list[str] = []
        for candidate in reversed(existing):
            problems = checkpoint_problems(candidate)
            if not problems:
                if damaged:
                    logger.warning(
                        "resuming from %s, the newest intact checkpoint; deleting the damaged %s (this run "
                        "saves those steps again).",
                        candidate,
                        _names(damaged),
                    )
                return StartPlan(candidate, damaged)
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            logger.warning("skipping damaged checkpoint %s: %s%s.", candidate, problems[0], more)
            damaged.append(candidate)
            reasons.append(f"{candidate.name}: {problems[0]}")
        raise ValueError(
            f"resume_from_checkpoint=True but no checkpoint in {output_dir} is intact ({'; '.join(reasons)}); "
            "resume from a copy, or start over with --overwrite_output_dir true."
        )
    checkpoint = Path(resume)
    if not checkpoint.is_dir():
        raise ValueError(
            f"resume_from_checkpoint: {resume} is not a folder (pass a checkpoint-* folder or true)."
        )
    verify_checkpoint(checkpoint)
    step = checkpoint_step(checkpoint)
    later = [p for p in existing if checkpoint_step(p) > step and not _same(p, checkpoint)]
    if later and not overwrite:
        raise ValueError(
            f"resume_from_checkpoint: output_dir {output_dir} holds {_names(later)}, saved after {checkpoint.name}, "
            "which this run would replace: resume from the latest with --resume_from_checkpoint true, or pass "
            "--overwrite_output_dir true to replace them."
        )
    if later:
        logger.warning("overwrite_output_dir: deleting %s, saved after %s.", _names(later), checkpoint)
    return StartPlan(checkpoint, later)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def remove_checkpoints(paths: list[Path]) -> None:
    """Delete checkpoint folders (main process only)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


# The folder and file a checkpoint of SAEPPOTrainer holds besides the model: accelerate's saved state
# (optimizer, scheduler, RNGs of every process) and the trainer state (step, episode, log history).
ACCELERATE_STATE_DIR = "accelerate_state"
TRAINER_STATE_FILE = _TRAINER_STATE_FILE


def publish_checkpoint(staging_dir: str | os.PathLike, final_dir: str | os.PathLike) -> None:
    """Finish a checkpoint written to ``staging_dir``: write its manifest (last: only a finished checkpoint
    has one) and rename it to ``final_dir``, replacing a folder of that name."""
    write_manifest(staging_dir)
    if os.path.exists(final_dir):
        shutil.rmtree(final_dir)
    os.replace(staging_dir, final_dir)


def rotate_checkpoints(output_dir: str | os.PathLike, limit: int | None, current_step: int) -> None:
    """Keep the newest ``limit`` checkpoints in ``output_dir``, counting only steps up to ``current_step``
    (None or <= 0: keep all)."""
    if limit is None or limit <= 0:
        return
    ours = [p for p in sorted_checkpoints(output_dir) if checkpoint_step(p) <= current_step]
    for old in ours[:-limit]:
        shutil.rmtree(old, ignore_errors=True)


def trainer_checkpoint_files(checkpoint: str | os.PathLike) -> tuple[str, str]:
    """``(accelerate state folder, trainer state file)`` of an SAEPPOTrainer checkpoint; a ValueError when
    either is missing."""
    state_dir = os.path.join(checkpoint, ACCELERATE_STATE_DIR)
    state_file = os.path.join(checkpoint, TRAINER_STATE_FILE)
    if not (os.path.isdir(state_dir) and os.path.isfile(state_file)):
        raise ValueError(
            f"{checkpoint} is not a complete SAEPPOTrainer checkpoint (needs {ACCELERATE_STATE_DIR}/ and "
            f"{TRAINER_STATE_FILE})."
        )
    return state_dir, state_file


# ----------------------------------------------------------------------------------------------------
# A full disk while saving
# ----------------------------------------------------------------------------------------------------
# What the writers say when a write comes up short: OSError(ENOSPC) from Python's own files, the text of
# it from safetensors (a Rust IoError), and torch.save's zip writer, which reports only the file position it
# expected ("[enforce fail at inline_container.cc:...] . unexpected pos ...") or "file write failed".
_DISK_FULL_TEXTS = ("no space left on device", "storagefull", "unexpected pos", "file write failed")


class CheckpointDiskFullError(RuntimeError):
    """A checkpoint that did not fit on the disk; the message says where, how much was free and needed."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a write that failed for lack of disk space."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(current).lower() for text in _DISK_FULL_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def folder_bytes(folder: str | os.PathLike) -> int:
    """Total size of the regular files under ``folder`` (0 when it does not exist)."""
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def disk_full_message(output_dir: str | os.PathLike, name: str, staged_bytes: int) -> str:
    """One line: the disk holding ``output_dir`` is full, what the checkpoint ``name`` needed, what is kept.

    The size needed is the previous checkpoint's (same model and optimizer, so the same size); without one,
    what was written before the write failed, a lower bound.
    """
    free = shutil.disk_usage(output_dir).free
    previous = [p for p in sorted_checkpoints(output_dir) if p.name != name]
    if previous:
        needed = f"about {_size(folder_bytes(previous[-1]))} (the size of {previous[-1].name})"
        kept = f"{previous[-1].name}, the last complete checkpoint, is kept"
    else:
        needed = f"more than the {_size(staged_bytes)} written before the write failed"
        kept = "no earlier checkpoint exists"
    return (
        f"Saving {name} failed: the disk holding output_dir {output_dir} is full ({_size(free)} free; "
        f"the checkpoint needs {needed}). The partial checkpoint was removed and {kept}; free space, lower "
        "save_total_limit or choose another output_dir, then continue with --resume_from_checkpoint true."
    )


# ----------------------------------------------------------------------------------------------------
# The trainer's save
# ----------------------------------------------------------------------------------------------------
# Beside the model, a checkpoint of SAEPPOTrainer holds the settings it ran with and a description of its
# model set-up, which resume compares with the current ones.
SETTINGS_FILE = "training_args.json"
MODEL_SETUP_FILE = "model_setup.json"


def save_trainer_checkpoint(trainer: SAEPPOTrainer) -> str:
    """Save ``checkpoint-<global_step>`` of ``trainer``: staged in ``tmp-checkpoint-<step>``, published with
    its manifest, then older checkpoints rotated. Every process calls it.

    Returns:
        The checkpoint's folder.

    Raises:
        CheckpointDiskFullError: the disk filled while saving; the staged folder is removed and the previous
            checkpoint kept (it is only ever replaced by renaming a complete one).
    """
    args, accelerator, state = trainer.args, trainer.accelerator, trainer.state
    name = f"{CHECKPOINT_PREFIX}-{state.global_step}"
    final_dir = os.path.join(args.output_dir, name)
    staging_dir = os.path.join(args.output_dir, f"tmp-{name}")
    if accelerator.is_main_process and os.path.exists(staging_dir):
        shutil.rmtree(staging_dir)
    accelerator.wait_for_everyone()

    def publish() -> None:
        if accelerator.is_main_process:
            state.save_to_json(os.path.join(staging_dir, TRAINER_STATE_FILE))
            _write_json(os.path.join(staging_dir, SETTINGS_FILE), args.to_dict())
            _write_json(
                os.path.join(staging_dir, MODEL_SETUP_FILE),
                model_setup(accelerator.unwrap_model(trainer.model)),
            )
            publish_checkpoint(staging_dir, final_dir)

    try:
        trainer.save_model(staging_dir, _internal_call=True)
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
        raise CheckpointDiskFullError(disk_full_message(args.output_dir, name, staged)) from error
    if accelerator.is_main_process:
        trainer._rotate_checkpoints()
    accelerator.wait_for_everyone()
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


def save_trainer_model(
    trainer: SAEPPOTrainer, output_dir: str | None = None, _internal_call: bool = False
) -> None:
    """The body of ``SAEPPOTrainer.save_model`` (see there). Every process calls it; when one process's
    writes fail, every process stops (:func:`write_on_every_process`)."""
    output_dir = output_dir or trainer.args.output_dir
    accelerator = trainer.accelerator
    wrapper = trainer.model
    # FSDP2 and DeepSpeed hold the weights in their own engines (FSDP2 and ZeRO-3 shard them): gather one
    # full state dict of the whole wrapper, a collective every rank joins (the main process receives it on
    # CPU), and save the policy and critic from it. transformers' Trainer.save_model cannot: it expects the
    # engine in `Trainer.deepspeed` and would save the wrapper's keys as the policy's.
    # accelerate < 1.6 (the declared floor is 1.4) has no FSDP2 and no `is_fsdp2`.
    gather = getattr(accelerator, "is_fsdp2", False) or trainer.is_deepspeed_enabled
    full_state = accelerator.get_state_dict(wrapper) if gather else None
    write_on_every_process(
        accelerator,
        lambda: _write_model_files(trainer, output_dir, full_state, gather),
        os.path.basename(os.path.normpath(output_dir)),
    )
    if trainer.args.push_to_hub and not _internal_call:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)


def _write_model_files(
    trainer: SAEPPOTrainer, output_dir: str, full_state: dict[str, Any] | None, gather: bool
) -> None:
    """This process's part of :func:`save_trainer_model`: the policy, the critic and the tokenizer (the
    main process writes; ``full_state`` is the wrapper's gathered state dict under FSDP2/DeepSpeed)."""
    from transformers import Trainer

    accelerator = trainer.accelerator
    wrapper = trainer.model
    unwrapped = accelerator.unwrap_model(wrapper)
    if trainer.is_peft_model:
        if accelerator.is_main_process:
            trainer._save_peft_policy(unwrapped, output_dir, full_state)
    elif gather:
        trainer.model = unwrapped.policy
        try:
            policy_state = _sub_state_dict(full_state, "policy.")
            Trainer._save(trainer, output_dir, state_dict=policy_state)
        finally:
            trainer.model = wrapper
    else:
        trainer.model = unwrapped.policy
        try:
            # Trainer.save_model would push with self.model swapped to the bare policy; we push below.
            Trainer.save_model(trainer, output_dir, _internal_call=True)
        finally:
            trainer.model = wrapper
    if trainer.args.save_value_model and unwrapped.has_critic and accelerator.is_main_process:
        unwrapped.save_critic(os.path.join(output_dir, "value_model"), state_dict=full_state)


def _sub_state_dict(state_dict: dict[str, Any] | None, prefix: str) -> dict[str, Any] | None:
    from trl_sae.trainer.critic import sub_state_dict

    return sub_state_dict(state_dict, prefix)


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
    trainer: SAEPPOTrainer,
    unwrapped: nn.Module,
    output_dir: str,
    full_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save a LoRA policy as its adapter (or merged into a full model with ``merge_adapters``) and the
    tokenizer; ``full_state`` (the wrapper's gathered keys, FSDP2/DeepSpeed) replaces the module's weights."""
    from trl_sae.trainer.critic import merge_adapter_into_full_model

    policy = unwrapped.policy
    adapter = getattr(unwrapped, "policy_adapter", policy.active_adapter)
    os.makedirs(output_dir, exist_ok=True)
    if trainer.args.merge_adapters:
        # Under ZeRO-3/FSDP2 the local weights are shards: merge the gathered ones. The merged model is built
        # whole on this process alone, never under DeepSpeed's zero.Init (a collective the others are not in).
        policy_state = _sub_state_dict(full_state, "policy.")
        with _without_zero3_init(trainer.accelerator):
            merged = merge_adapter_into_full_model(policy, adapter, state_dict=policy_state)
        merged.save_pretrained(output_dir)
    elif full_state is not None:
        policy.save_pretrained(
            output_dir, selected_adapters=[adapter], state_dict=_sub_state_dict(full_state, "policy.")
        )
    else:
        policy.save_pretrained(output_dir, selected_adapters=[adapter])
    trainer.processing_class.save_pretrained(output_dir)


# ----------------------------------------------------------------------------------------------------
# What a checkpoint was saved with, compared on resume
# ----------------------------------------------------------------------------------------------------
# The settings of a model's config that fix the shapes of its weights.
_SHAPE_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)
_LORA_KEYS = (
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "modules_to_save",
    "use_dora",
    "use_rslora",
    "bias",
)
# Differences a checkpoint's weights still load into, as (section, setting): the run continues with a warning
# (a model found under another name or path). LoRA's alpha is no weight, but it scales what the saved adapter
# adds: another value would continue the run with another function than the one trained, so it is refused.
_LOADABLE_DIFFERENCES = {
    ("policy", "model"),
    ("critic model", "model"),
}


def _plain(value: Any) -> Any:
    """A JSON value for a config value: sets and tuples as sorted lists, enums by value."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
        return value.value
    return value


def _describe_model(model: nn.Module) -> dict[str, Any]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    described: dict[str, Any] = {
        "model": getattr(config, "_name_or_path", None) or None,
        "class": type(base).__name__,
    }
    for key in _SHAPE_CONFIG_KEYS:
        if hasattr(config, key):
            described[key] = _plain(getattr(config, key))
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        described["quantization"] = _plain(
            getattr(quantization, "quant_method", None) or quantization.get("quant_method")
        )
    return described


def _describe_lora(model: nn.Module, adapter: str) -> dict[str, Any]:
    config = model.peft_config[adapter]
    return {key: _plain(getattr(config, key)) for key in _LORA_KEYS if hasattr(config, key)}


def model_setup(wrapper: nn.Module) -> dict[str, Any]:
    """What fixes the policy's and critic's weights in a checkpoint, by section: ``policy`` (model, class and
    sizes), ``policy LoRA`` (rank, alpha, target modules, ...; None without LoRA), ``critic`` (its kind),
    ``critic model`` and ``critic LoRA``; JSON values.

    Args:
        wrapper: the unwrapped policy-and-critic module (``PolicyAndCritic`` or ``SharedBaseCritic``).
    """
    policy = wrapper.policy
    setup: dict[str, Any] = {"policy": _describe_model(policy), "policy LoRA": None}
    if hasattr(policy, "peft_config"):
        setup["policy LoRA"] = _describe_lora(
            policy, getattr(wrapper, "policy_adapter", None) or policy.active_adapter
        )
    critic_adapter = getattr(wrapper, "critic_adapter", None)
    critic = getattr(wrapper, "critic", None)
    setup.update({"critic": "none", "critic model": None, "critic LoRA": None})
    if critic_adapter is not None:
        setup["critic"] = "a LoRA adapter and value head on the policy's base (value_model='shared')"
        setup["critic LoRA"] = _describe_lora(policy, critic_adapter)
    elif critic is not None:
        setup["critic"] = "a separate value model"
        setup["critic model"] = _describe_model(critic)
        if hasattr(critic, "peft_config"):
            setup["critic LoRA"] = _describe_lora(critic, critic.active_adapter)
    return json.loads(json.dumps(setup, default=str))


def _brief(section: dict[str, Any] | str | None) -> str:
    """A section of :func:`model_setup` in a few words: none, the model, or the LoRA's main settings."""
    if section is None:
        return "none"
    if not isinstance(section, dict):
        return repr(section)
    if "r" in section:
        return f"(r={section['r']}, lora_alpha={section.get('lora_alpha')}, target_modules={section.get('target_modules')})"
    return f"({section.get('class')} {section.get('model')!r})"


def model_setup_differences(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(blocking, loadable)``: ``"setting saved -> current"`` for each difference between two
    :func:`model_setup` descriptions; the weights cannot load when ``blocking`` is not empty.

    A section present on one side only (LoRA on one side, no LoRA on the other) is one difference; so is
    another kind of critic, whose details are then not compared.
    """
    blocking: list[str] = []
    loadable: list[str] = []
    kind_differs = saved.get("critic") != current.get("critic")
    for section in dict.fromkeys([*saved, *current]):
        before, after = saved.get(section), current.get(section)
        if before == after or (kind_differs and section in ("critic model", "critic LoRA")):
            continue
        if not (isinstance(before, dict) and isinstance(after, dict)):
            blocking.append(f"{section} {_brief(before)} -> {_brief(after)}")
            continue
        for key in dict.fromkeys([*before, *after]):
            if before.get(key) != after.get(key):
                found = loadable if (section, key) in _LOADABLE_DIFFERENCES else blocking
                found.append(f"{section} {key} {before.get(key)!r} -> {after.get(key)!r}")
    return blocking, loadable


def _differences(saved: dict[str, Any], current: dict[str, Any], keys: list[str]) -> list[str]:
    missing = "(not set)"
    return [f"{key} {saved.get(key, missing)!r} -> {current.get(key, missing)!r}" for key in keys]


# Settings that say where, for how long and how loudly a run writes and logs: continuing a run with other
# values is what resuming is for. Batch sizes derived from others (batch_size, ...) are left out too: the
# settings they come from are compared.
_RESUME_FREE_SETTINGS = frozenset(
    {
        "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "max_steps", "num_train_epochs",
        "total_episodes", "num_total_batches", "batch_size", "local_batch_size", "mini_batch_size",
        "local_mini_batch_size", "micro_batch_size", "run_name", "project", "report_to", "disable_tqdm",
        "log_level", "log_level_replica", "log_on_each_node", "logging_dir", "logging_strategy", "logging_steps",
        "logging_first_step", "logging_nan_inf_filter", "save_strategy", "save_steps", "save_total_limit",
        "save_on_each_node", "save_only_model", "save_value_model", "eval_strategy", "eval_steps", "eval_delay",
        "eval_on_start", "per_device_eval_batch_size", "push_to_hub", "hub_model_id", "hub_strategy",
        "hub_token", "hub_private_repo", "hub_always_push", "hub_revision", "trackio_space_id",
        "trackio_bucket_id", "trackio_static_space_id", "log_completions", "num_completions_to_print",
        "num_sample_generations", "skip_memory_metrics", "dataloader_num_workers", "dataset_num_proc",
        "ddp_timeout", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
        "local_rank", "debug", "do_train", "do_eval", "do_predict",
    }
)  # fmt: skip


# Settings whose value a checkpoint carries in its state, so a resumed run cannot take another one: refused
# on resume, with why. The optimizer's hyperparameters (learning rates, betas, eps, weight decay) and the
# learning-rate schedule are state too, but they are re-applied from the current settings instead (see
# :func:`replan_schedule`); every other setting is read by the trainer when it is used, so a new value takes
# effect at the resumed step.
_RESUME_FIXED_SETTINGS = {
    "optim": "the checkpoint's optimizer state (e.g. Adam's moments) belongs to the optimizer it was saved with",
    "optim_args": "the checkpoint's optimizer state belongs to the optimizer it was saved with",
    "seed": "the checkpoint carries the random number generators' states, which continue the saved run's streams",
    "fp16": "fp16's loss scaler is saved with the checkpoint's state (or missing from it)",
}


def fixed_setting_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"name saved -> current (why)"`` for each setting of :data:`_RESUME_FIXED_SETTINGS` that differs."""
    current = json.loads(json.dumps(current, default=str))
    return [
        f"{key} {saved.get(key)!r} -> {current.get(key)!r} ({reason})"
        for key, reason in _RESUME_FIXED_SETTINGS.items()
        if key in saved and saved.get(key) != current.get(key)
    ]


def settings_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"name saved -> current"`` for each training setting (``SAEPPOConfig.to_dict()`` form) that differs
    between a checkpoint and this run, ignoring where/how long/how loudly a run writes and logs."""
    current = json.loads(json.dumps(current, default=str))  # the saved file's JSON form
    keys = [
        key
        for key in dict.fromkeys([*saved, *current])
        if key not in _RESUME_FREE_SETTINGS and saved.get(key) != current.get(key)
    ]
    return _differences(saved, current, keys)


# ----------------------------------------------------------------------------------------------------
# The trainer's resume
# ----------------------------------------------------------------------------------------------------
def plan_trainer_start(trainer: SAEPPOTrainer, resume: str | bool | None) -> str | None:
    """The checkpoint to resume from (None: fresh), after refusing or clearing old checkpoints.

    The main process verifies and deletes (see :func:`plan_training_start`) and broadcasts the outcome, so
    every process resumes from the same folder or raises the same error.
    """
    from accelerate.utils import broadcast_object_list

    accelerator, args = trainer.accelerator, trainer.args
    outcome: list[Any] = [None, None]  # [checkpoint path, error message]
    if accelerator.is_main_process:
        try:
            plan = plan_training_start(args.output_dir, resume, args.overwrite_output_dir)
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


def fresh_schedule(trainer: SAEPPOTrainer) -> FreshSchedule:
    """The current settings' optimizer hyperparameters and step-0 schedule (call it before loading a state)."""
    optimizer = trainer.lr_scheduler.optimizer
    groups = [
        {k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    ]
    return FreshSchedule(groups, copy.deepcopy(trainer.lr_scheduler.state_dict()))


def replan_schedule(trainer: SAEPPOTrainer, fresh: FreshSchedule, step: int) -> None:
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
    scheduler = trainer.lr_scheduler
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


def _group_lrs(trainer: SAEPPOTrainer) -> list[float]:
    return [float(group["lr"]) for group in trainer.lr_scheduler.optimizer.param_groups]


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


def load_trainer_checkpoint(trainer: SAEPPOTrainer, checkpoint: str) -> None:
    """Load a checkpoint that :func:`plan_trainer_start` chose and verified against its manifest.

    Before any weight is read: a model set-up the weights cannot load into (or would compute another
    function with: LoRA's alpha) is one ValueError naming each difference, and so is a change of a setting
    the checkpoint's state fixes (:data:`_RESUME_FIXED_SETTINGS`). Then the state is loaded, the optimizer's
    hyperparameters and the learning-rate schedule are re-planned from the current settings
    (:func:`replan_schedule`), and the other differences of set-up or settings are one warning (main
    process): the run continues with the current ones.
    """
    from trl.experimental.ppo.ppo_trainer import OnlineTrainerState

    from trl_sae.trainer.dynamic_sampling import restore_prompt_stream

    accelerator = trainer.accelerator
    state_dir, state_file = trainer_checkpoint_files(checkpoint)
    warnings_found: list[str] = []
    saved_setup = _read_json(os.path.join(checkpoint, MODEL_SETUP_FILE))
    if saved_setup is not None:
        blocking, loadable = model_setup_differences(
            saved_setup, model_setup(accelerator.unwrap_model(trainer.model))
        )
        if blocking:
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} was saved with another model set-up, which its weights "
                f"cannot load into or would compute another function with: {'; '.join(blocking)}. Resume with "
                "the model, LoRA and critic settings it was saved with, or start a fresh run."
            )
        warnings_found += loadable
    saved_settings = _read_json(os.path.join(checkpoint, SETTINGS_FILE))
    if saved_settings is not None:
        current = trainer.args.to_dict()
        fixed = fixed_setting_changes(saved_settings, current)
        if fixed:
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} was saved with settings a resumed run cannot change: "
                f"{'; '.join(fixed)}. Resume with the values it was saved with, or start a fresh run."
            )
        warnings_found += settings_differences(saved_settings, current)
    fresh = fresh_schedule(trainer)
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
    saved = OnlineTrainerState.load_from_json(state_file)
    trainer.state.global_step = saved.global_step
    trainer.state.episode = saved.episode
    trainer.state.epoch = saved.epoch
    trainer.state.log_history = saved.log_history
    restore_prompt_stream(trainer.state, saved)  # filter_groups: where the prompt order continues
    trainer._vllm_weights_stale = True
    restored = _group_lrs(trainer)
    replan_schedule(trainer, fresh, saved.global_step)
    note = _schedule_note(restored, _group_lrs(trainer), saved.global_step, trainer.args.num_total_batches)
    if accelerator.is_main_process and (warnings_found or note):
        differ = (
            f" with settings that differ from the ones it was saved with: {'; '.join(warnings_found)} (this run "
            "continues with the current ones)"
            if warnings_found
            else ""
        )
        logger.warning("resuming from %s%s%s.", checkpoint, differ, f"; {note}" if note else "")
