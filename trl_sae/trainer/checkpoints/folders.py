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

The second half says what a checkpoint was saved with and what a resume refuses: :func:`model_setup` describes
the model set-up its weights fix (:data:`MODEL_SETUP_FILE`); a resumed run may not change it in a way the
weights cannot load into or would compute another function with (:func:`model_setup_differences`), nor a
setting the checkpoint's state fixes (:func:`fixed_setting_changes`: the optimizer, the seed, fp16); the other
differences from the saved settings (:data:`SETTINGS_FILE`) are warned about (:func:`settings_differences`).

Standard library only; the trainer runs the planning on the main process and shares the outcome with the
others. Saving and loading the training state itself (what a checkpoint holds, staged saves, FSDP2/DeepSpeed
gathering, re-planning the schedule on resume) is :mod:`trl_sae.trainer.checkpoints.state`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_sae.trainer.config.outputs import parse_resume_flag
from trl_sae.trainer.setup.adapters import base_model

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ACCELERATE_STATE_DIR",
    "CHECKPOINT_PREFIX",
    "MANIFEST_NAME",
    "MODEL_SETUP_FILE",
    "SETTINGS_FILE",
    "TRAINER_STATE_FILE",
    "TRAIN_PROMPTS_KEY",
    "CheckpointDiskFullError",
    "DamagedCheckpointError",
    "StartPlan",
    "check_fresh_start",
    "checkpoint_problems",
    "checkpoint_step",
    "disk_full_message",
    "fixed_setting_changes",
    "folder_bytes",
    "is_disk_full",
    "model_setup",
    "model_setup_differences",
    "parse_resume_flag",
    "plan_training_start",
    "prompt_order_changes",
    "publish_checkpoint",
    "remove_checkpoints",
    "rotate_checkpoints",
    "settings_differences",
    "sorted_checkpoints",
    "trainer_checkpoint_files",
    "verify_checkpoint",
    "write_manifest",
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
# What a checkpoint was saved with, compared on resume
# ----------------------------------------------------------------------------------------------------
# Beside the model, a checkpoint of SAEPPOTrainer holds the settings it ran with and a description of its
# model set-up, which resume compares with the current ones (trl_sae/trainer/checkpoints/state.py saves them).
SETTINGS_FILE = "training_args.json"
# The train dataset's length, saved beside the settings in SETTINGS_FILE.
TRAIN_PROMPTS_KEY = "trl_sae_train_prompts"
MODEL_SETUP_FILE = "model_setup.json"
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
    base = base_model(model)
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
        wrapper: the unwrapped policy-and-critic module (``PolicyAndCritic``, ``SharedBaseCritic`` or
            ``HeadCritic``).
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
    elif hasattr(wrapper, "capture_values"):  # HeadCritic: its kind names the layer it reads
        setup["critic"] = wrapper.kind
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


def _prompts_per_step(settings: dict[str, Any]) -> int | None:
    batch, generations = settings.get("batch_size"), settings.get("num_generations")
    return batch // generations if isinstance(batch, int) and isinstance(generations, int) else None


def _data_seed(settings: dict[str, Any]) -> Any:
    return settings.get("data_seed") if settings.get("data_seed") is not None else settings.get("seed")


def prompt_order_changes(
    saved: dict[str, Any],
    current: dict[str, Any],
    position: int,
    train_prompts: int | None,
    saved_train_prompts: int | None = None,
) -> list[str]:
    """``"what saved -> current (why)"`` for each change that would make a resumed run draw other prompts than
    the saved run would have: refused on resume, like :func:`fixed_setting_changes`.

    The prompt order (``Rollouts.prompt_indices``) is an epoch-wise shuffle seeded by the data seed
    (``data_seed``, else ``seed``) and cut into batches of the per-step prompt count, and a checkpoint
    records where it stands as ``position`` prompt batches drawn. Another per-step prompt count reads that
    position in batches of another size: the rest of the run would repeat some prompts of the epoch and skip
    others, at an epoch boundary too, so it is refused wherever the checkpoint is. Another data seed
    mid-epoch would finish the epoch in another order (repeating and skipping prompts the same way); at an
    epoch boundary it only orders the coming epochs, so it is allowed there (and listed in the resume
    warning). ``train_prompts``: the train dataset's length, which places ``position`` in its epoch (None:
    every position counts as mid-epoch). ``saved_train_prompts``: the length the checkpoint's run shuffled
    (None: not recorded, checkpoints before it was); another length mid-epoch would finish that epoch over
    another set of prompts (refused), at an epoch boundary it only changes the coming epochs (allowed).
    """
    current = json.loads(json.dumps(current, default=str))
    saved_count, current_count = _prompts_per_step(saved), _prompts_per_step(current)
    if saved_count is not None and current_count is not None and saved_count != current_count:
        return [
            f"prompts per step {saved_count} -> {current_count} (batch_size / num_generations, with batch_size = "
            "per_device_train_batch_size x gradient_accumulation_steps x processes: the checkpoint's place in "
            f"the prompt order is {position} prompt batches of {saved_count})"
        ]
    steps_per_epoch = train_prompts // current_count if train_prompts and current_count else 0
    at_boundary = steps_per_epoch > 0 and position % steps_per_epoch == 0
    if saved_train_prompts is not None and train_prompts is not None and saved_train_prompts != train_prompts:
        saved_steps = saved_train_prompts // current_count if current_count else 0
        if not (saved_steps > 0 and position % saved_steps == 0):
            return [
                f"train dataset length {saved_train_prompts} -> {train_prompts} prompts (the checkpoint stands "
                f"mid-epoch, at prompt batch {position % saved_steps if saved_steps else position} of "
                f"{saved_steps}, in a shuffle of {saved_train_prompts} prompts: the rest of the epoch would repeat "
                "some and skip others; another dataset is taken at an epoch boundary)"
            ]
    if "seed" in saved and _data_seed(saved) != _data_seed(current) and not at_boundary:
        where = (
            f"prompt batch {position % steps_per_epoch} of {steps_per_epoch}"
            if steps_per_epoch
            else "mid-epoch"
        )
        return [
            f"data seed {_data_seed(saved)!r} -> {_data_seed(current)!r} (data_seed, else seed: the checkpoint "
            f"stands at {where} of an epoch whose order that seed shuffled; another seed is taken at an epoch "
            "boundary)"
        ]
    return []


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
