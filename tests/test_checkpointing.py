"""Resume and checkpoint safety: the recipe path resumes, a fresh run never writes over old checkpoints,
and a damaged checkpoint (checked against its manifest) is skipped or refused, never loaded."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from tests.scenarios import in_the_ddp_launch
from tests.test_trainer import make_config, make_dataset, parameters_of, vowel_fraction
from trl_sae import SAEPPOTrainer
from trl_sae.cli.app import main
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.recipe import parse_recipe, run_recipe
from trl_sae.trainer.checkpoints.folders import (
    MANIFEST_NAME,
    MODEL_SETUP_FILE,
    CheckpointDiskFullError,
    DamagedCheckpointError,
    _size,
    checkpoint_problems,
    folder_bytes,
    is_disk_full,
    parse_resume_flag,
    verify_checkpoint,
    write_manifest,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class RecordSteps(TrainerCallback):
    """Remembers the global step at the end of every step this process trained."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        return control


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a folder with its modification time (ns) and bytes: equal means not rewritten."""
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def episodes_of(checkpoint: Path) -> list[int]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return [entry["episode"] for entry in state["log_history"] if "reward/mean" in entry]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ----------------------------------------------------------------------------------------------------
# The manifest on its own
# ----------------------------------------------------------------------------------------------------
def test_manifest_names_each_kind_of_damage(tmp_path):
    folder = tmp_path / "checkpoint-7"
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"\x00\x01" * 500)
    (folder / "sub" / "state.json").write_text('{"step": 7}')
    assert checkpoint_problems(folder) == [
        f"no {MANIFEST_NAME} (an interrupted copy, or saved by a trl-sae without manifests)"
    ]
    manifest = json.loads(write_manifest(folder).read_text())
    assert manifest["files"]["weights.bin"]["size"] == 1000
    assert sorted(manifest["files"]) == ["sub/state.json", "weights.bin"]
    assert checkpoint_problems(folder) == []

    (folder / "sub" / "state.json").write_text('{"step": 8}')  # same size, other bytes
    assert checkpoint_problems(folder) == [
        "sub/state.json does not match its SHA-256 in the manifest (its contents changed after the save)"
    ]
    truncate(folder / "weights.bin")
    assert "weights.bin is 500 bytes, the manifest says 1000" in checkpoint_problems(folder)
    (folder / "weights.bin").unlink()
    assert "weights.bin is missing" in checkpoint_problems(folder)
    with pytest.raises(
        DamagedCheckpointError, match=r"checkpoint .*checkpoint-7 is damaged: weights.bin is missing"
    ):
        verify_checkpoint(folder)
    (folder / MANIFEST_NAME).write_text('{"version": 1, "files": {"weights.bin": {"si')  # cut short
    assert checkpoint_problems(folder)[0].startswith(f"{MANIFEST_NAME} is unreadable (")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (False, None), ("", None), ("false", None), ("False", None), (True, True), ("true", True),
     ("True", True), ("out/checkpoint-2", "out/checkpoint-2")],
)  # fmt: skip
def test_resume_flag_reads_true_and_false_strings_as_transformers_users_expect(value, expected):
    assert parse_resume_flag(value) == expected


# ----------------------------------------------------------------------------------------------------
# The trainer (Python API): fresh runs, damaged checkpoints, exact resume
# ----------------------------------------------------------------------------------------------------
def _trainer(output_dir: Path, tokenizer, max_steps: int = 2, callbacks=None, **overrides) -> SAEPPOTrainer:
    config = make_config(
        output_dir.parent,
        output_dir=str(output_dir),
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=1,
        **overrides,
    )
    return SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=config,
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, tokenizer):
    """A 2-step run saving checkpoint-1 and checkpoint-2, with its final weights and rewards."""
    torch.manual_seed(0)
    output_dir = tmp_path_factory.mktemp("two-steps") / "out"
    trainer = _trainer(output_dir, tokenizer)
    trainer.train()
    weights = parameters_of(trainer.accelerator.unwrap_model(trainer.model))
    rewards = [e["reward/mean"] for e in trainer.state.log_history if "reward/mean" in e]
    return output_dir, weights, rewards


@pytest.fixture
def run_copy(tmp_path, two_step_run):
    """A private copy (modification times kept) of the 2-step run's output_dir."""
    output_dir = tmp_path / "out"
    shutil.copytree(two_step_run[0], output_dir)
    return output_dir


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_before_any_step(run_copy, tokenizer):
    before = snapshot(run_copy)
    steps = RecordSteps()
    trainer = _trainer(run_copy, tokenizer, callbacks=[steps])
    with pytest.raises(ValueError) as error:
        trainer.train()
    message = str(error.value)
    assert "\n" not in message and "checkpoint-1, checkpoint-2" in message
    assert "--resume_from_checkpoint true" in message and "--overwrite_output_dir true" in message
    assert steps.steps == [] and snapshot(run_copy) == before


def test_overwrite_output_dir_deletes_the_old_checkpoints_first(run_copy, tokenizer):
    old = snapshot(run_copy / "checkpoint-1")
    trainer = _trainer(run_copy, tokenizer, max_steps=1, overwrite_output_dir=True)
    trainer.train()
    assert sorted(p.name for p in run_copy.glob("checkpoint-*")) == ["checkpoint-1"]  # checkpoint-2 is gone
    new = snapshot(run_copy / "checkpoint-1")
    assert new["trainer_state.json"][0] != old["trainer_state.json"][0]  # written by this run
    assert checkpoint_problems(run_copy / "checkpoint-1") == []


DAMAGED_FILES = [
    "model.safetensors",
    "accelerate_state/model.safetensors",
    "accelerate_state/optimizer.bin",
    "trainer_state.json",
    "accelerate_state/random_states_0.pkl",
]


@pytest.mark.parametrize("damaged", DAMAGED_FILES)
def test_resume_true_skips_a_damaged_checkpoint_and_equals_the_uninterrupted_run(
    run_copy, tokenizer, two_step_run, caplog, damaged
):
    truncate(run_copy / "checkpoint-2" / damaged)
    steps = RecordSteps()
    trainer = _trainer(run_copy, tokenizer, callbacks=[steps])
    with caplog.at_level(logging.WARNING, logger="trl_sae.trainer.checkpoints.folders"):
        trainer.train(resume_from_checkpoint=True)
    warning = next(r.getMessage() for r in caplog.records if "skipping" in r.getMessage())
    assert warning.startswith(f"skipping damaged checkpoint {run_copy / 'checkpoint-2'}: {damaged} is ")
    assert "bytes, the manifest says" in warning
    assert steps.steps == [2]  # resumed from checkpoint-1: only step 2 ran
    weights = parameters_of(trainer.accelerator.unwrap_model(trainer.model))
    for name, expected in two_step_run[1].items():
        torch.testing.assert_close(weights[name], expected, atol=1e-6, rtol=1e-5, msg=name)
    rewards = [e["reward/mean"] for e in trainer.state.log_history if "reward/mean" in e]
    assert rewards == pytest.approx(two_step_run[2])
    assert checkpoint_problems(run_copy / "checkpoint-2") == []  # saved again, intact


@pytest.mark.parametrize("damaged", DAMAGED_FILES)
def test_an_explicit_damaged_checkpoint_is_a_one_line_error(run_copy, tokenizer, damaged):
    truncate(run_copy / "checkpoint-2" / damaged)
    steps = RecordSteps()
    trainer = _trainer(run_copy, tokenizer, max_steps=3, callbacks=[steps])
    with pytest.raises(DamagedCheckpointError) as error:
        trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-2"))
    message = str(error.value)
    assert isinstance(error.value, ValueError) and "\n" not in message
    assert f"{run_copy / 'checkpoint-2'} is damaged: {damaged} is " in message
    assert steps.steps == []


def test_every_checkpoint_damaged_is_an_error_naming_each(run_copy, tokenizer):
    truncate(run_copy / "checkpoint-2" / "trainer_state.json")
    (run_copy / "checkpoint-1" / MANIFEST_NAME).unlink()
    trainer = _trainer(run_copy, tokenizer)
    with pytest.raises(ValueError, match=r"no checkpoint in .* is intact \(checkpoint-2: trainer_state.json is \d+ "
                       r"bytes.*; checkpoint-1: no checkpoint_manifest.json"):  # fmt: skip
        trainer.train(resume_from_checkpoint="true")
    assert (run_copy / "checkpoint-1").is_dir() and (run_copy / "checkpoint-2").is_dir()  # nothing deleted


def test_resuming_before_later_checkpoints_needs_overwrite_output_dir(run_copy, tokenizer):
    trainer = _trainer(run_copy, tokenizer)
    with pytest.raises(
        ValueError, match=r"holds checkpoint-2, saved after checkpoint-1.*--overwrite_output_dir"
    ):
        trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    assert checkpoint_problems(run_copy / "checkpoint-2") == []
    steps = RecordSteps()
    trainer = _trainer(run_copy, tokenizer, callbacks=[steps], overwrite_output_dir=True)
    trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    assert steps.steps == [2]


# ----------------------------------------------------------------------------------------------------
# A full disk while saving
# ----------------------------------------------------------------------------------------------------
DISK_FULL_ERRORS = {
    "ENOSPC": OSError(errno.ENOSPC, "No space left on device"),
    # What torch.save's zip writer raises when the disk fills (the report).
    "torch": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4544 vs 4432"),
}


@pytest.mark.parametrize("kind", DISK_FULL_ERRORS)
def test_a_full_disk_is_one_clear_error_and_keeps_the_last_good_checkpoint(
    run_copy, tokenizer, monkeypatch, kind
):
    save = torch.save

    def disk_fills_in_checkpoint_3(obj, f, *args, **kwargs):
        if "tmp-checkpoint-3" in str(f):  # the optimizer state of the third checkpoint: half of it fits
            Path(f).write_bytes(b"\x00" * 100)
            raise DISK_FULL_ERRORS[kind]
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills_in_checkpoint_3)
    before = snapshot(run_copy / "checkpoint-2")
    trainer = _trainer(run_copy, tokenizer, max_steps=3)
    with pytest.raises(CheckpointDiskFullError) as error:
        trainer.train(resume_from_checkpoint=True)
    message = str(error.value)
    needed = _size(folder_bytes(run_copy / "checkpoint-2"))
    assert "\n" not in message
    assert message.startswith(f"Saving checkpoint-3 failed: the disk holding output_dir {run_copy} is full (")
    assert f"the checkpoint needs about {needed} (the size of checkpoint-2)" in message
    assert "checkpoint-2, the last complete checkpoint, is kept" in message
    assert sorted(p.name for p in run_copy.iterdir()) == ["checkpoint-1", "checkpoint-2"]  # no partial one
    assert (
        snapshot(run_copy / "checkpoint-2") == before and checkpoint_problems(run_copy / "checkpoint-2") == []
    )


def test_disk_full_is_told_from_other_write_errors():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(
        RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, .. })")
    )
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(RuntimeError("CUDA out of memory"))


# ----------------------------------------------------------------------------------------------------
# Resuming with other settings or another model set-up
# ----------------------------------------------------------------------------------------------------
def test_resuming_with_other_settings_warns_once_naming_each(run_copy, tokenizer, caplog):
    def differences_warned(**settings) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trl_sae.trainer.checkpoints.folders"):
            _trainer(run_copy, tokenizer, callbacks=[steps], **settings).train(resume_from_checkpoint=True)
        return [
            r.getMessage()
            for r in caplog.records
            if "differ from the ones it was saved with" in r.getMessage()
        ]

    steps = RecordSteps()
    # max_steps and output_dir change on every resume: not differences worth a word.
    assert differences_warned(max_steps=3) == []
    warnings = differences_warned(max_steps=4, learning_rate=1e-3, kl_coef=0.2)
    assert steps.steps == [3, 4]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"resuming from {run_copy / 'checkpoint-3'} with settings that differ")
    differences = warnings[0].split(": ", 1)[1].split(" (this run continues")[0].split("; ")
    assert differences == ["learning_rate 0.003 -> 0.001", "kl_coef 0.0 -> 0.2"]


class RecordRates(TrainerCallback):
    """The hyperparameters of each optimizer parameter group at the start of each step: the ones it trains with."""

    def __init__(self) -> None:
        self.groups: list[list[dict]] = []

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.groups.append([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
        return control


def _logged_lrs(trainer) -> list[float]:
    return [entry["lr"] for entry in trainer.state.log_history if "lr" in entry]


def _rates(record: RecordRates, key: str = "lr") -> list[set]:
    return [{group[key] for group in groups} for groups in record.groups]


def test_a_learning_rate_changed_on_resume_is_the_one_trained_with(tmp_path, tokenizer, caplog):
    """Issue 29: a constant-lr run resumed with --learning_rate 5e-4 trained on at the saved 1e-4."""
    output_dir = tmp_path / "out"
    settings = dict(lr_scheduler_type="constant", learning_rate=1e-4, critic_learning_rate=1e-4)
    _trainer(output_dir, tokenizer, max_steps=1, **settings).train()
    record = RecordRates()
    settings.update(
        learning_rate=5e-4, critic_learning_rate=2e-3, adam_beta1=0.8, adam_epsilon=1e-6, weight_decay=0.1
    )
    trainer = _trainer(output_dir, tokenizer, max_steps=2, callbacks=[record], **settings)
    with caplog.at_level(logging.WARNING, logger="trl_sae.trainer.checkpoints.folders"):
        trainer.train(resume_from_checkpoint=True)
    groups = record.groups[0]  # step 2, the only one this run trains
    assert len(record.groups) == 1
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    actor = {id(p) for p in unwrapped.actor_parameters()}
    optimizer = trainer.lr_scheduler.optimizer
    for group, hyper in zip(optimizer.param_groups, groups, strict=True):
        is_actor = all(id(p) in actor for p in group["params"])
        assert hyper["lr"] == (5e-4 if is_actor else 2e-3)
        assert hyper["betas"][0] == 0.8 and hyper["eps"] == 1e-6
        assert hyper["weight_decay"] in (0.0, 0.1)
    assert {g["weight_decay"] for g in groups} == {0.0, 0.1}  # decayed and no-decay groups
    assert _logged_lrs(trainer)[-1] == 5e-4
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming from")]
    assert "learning_rate 0.0001 -> 0.0005" in warning
    assert "step 2 trains at lr 0.0001 -> 0.002, 0.0001 -> 0.0005 (the checkpoint's -> the current" in warning


@pytest.mark.parametrize(
    ("scheduler", "factor"),
    [
        ("linear", 1 - 2 / 3),  # the old code trained this step at lr 0: the 2-step schedule's end
        ("cosine", 0.5 * (1 + math.cos(math.pi * 2 / 3))),
    ],
)
def test_extending_max_steps_on_resume_replans_the_schedule(run_copy, tokenizer, caplog, scheduler, factor):
    """Issue 29: a 2-step linear run resumed with max_steps=3 trained step 3 at lr 0. The schedule is now the
    one the current settings give over the new length, at the resumed step."""
    record = RecordRates()
    trainer = _trainer(run_copy, tokenizer, max_steps=3, callbacks=[record], lr_scheduler_type=scheduler)
    with caplog.at_level(logging.WARNING, logger="trl_sae.trainer.checkpoints.folders"):
        trainer.train(resume_from_checkpoint=True)
    (step_3,) = record.groups
    assert [group["lr"] for group in step_3] == pytest.approx([3e-3 * factor] * len(step_3))
    assert _logged_lrs(trainer)[-1] == pytest.approx(3e-3 * factor)
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming from")]
    assert (
        f"re-planned from the current settings over 3 steps, so step 3 trains at lr 0 -> {3e-3 * factor:.6g} "
        in warning
    )


def test_settings_a_checkpoint_fixes_are_refused_on_resume_before_any_step(run_copy, tokenizer):
    steps = RecordSteps()
    trainer = _trainer(run_copy, tokenizer, max_steps=3, callbacks=[steps], seed=1, optim="sgd")
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    message = str(error.value)
    assert "\n" not in message and steps.steps == []
    assert message.startswith(
        f"resume_from_checkpoint: {run_copy / 'checkpoint-2'} was saved with settings a resumed run cannot change: "
        "optim 'adamw_torch_fused' -> 'sgd' (the checkpoint's optimizer state"
    )
    assert "; seed 0 -> 1 (the checkpoint carries the random number generators' states" in message
    assert message.endswith(". Resume with the values it was saved with, or start a fresh run.")


def test_a_prompt_order_change_mid_epoch_is_refused_on_resume(run_copy, tokenizer):
    """Issue 48: another per-step prompt count or data seed at checkpoint-2 (prompt batch 2 of 8: 16 prompts, 2
    per step) made the rest of the epoch train on other prompts than the saved run's, silently."""
    steps = RecordSteps()
    checkpoint = run_copy / "checkpoint-2"
    for settings, change in [
        ({"num_generations": 2}, "prompts per step 2 -> 4 (batch_size / num_generations"),
        ({"per_device_train_batch_size": 16}, "prompts per step 2 -> 4 (batch_size / num_generations"),
        (
            {"data_seed": 5},
            "data seed 0 -> 5 (data_seed, else seed: the checkpoint stands at prompt batch 2 of 8",
        ),
    ]:
        trainer = _trainer(run_copy, tokenizer, max_steps=3, callbacks=[steps], **settings)
        with pytest.raises(ValueError) as error:
            trainer.train(resume_from_checkpoint=True)
        message = str(error.value)
        assert "\n" not in message and steps.steps == []
        assert message.startswith(
            f"resume_from_checkpoint: {checkpoint} was saved with settings a resumed run cannot change: {change}"
        )
        assert message.endswith(". Resume with the values it was saved with, or start a fresh run.")


def test_a_data_seed_change_at_an_epoch_boundary_orders_the_next_epoch(tmp_path, tokenizer, monkeypatch):
    """4 prompts, 2 per step: checkpoint-2 ends epoch 0, so data_seed=7 is taken (with the warning) and step 3
    draws the first two prompts of epoch 1 shuffled by seed 7 + 1; checkpoint-1 is mid-epoch: refused."""
    from trl_sae.trainer.parts.rollout import Rollouts

    def trainer(output_dir: Path, max_steps: int, **overrides) -> SAEPPOTrainer:
        config = make_config(
            tmp_path,
            output_dir=str(output_dir),
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=1,
            **overrides,
        )
        return SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0),
            reward_funcs=vowel_fraction,
            args=config,
            train_dataset=make_dataset(4),
            processing_class=tokenizer,
        )

    trainer(tmp_path / "out", 2).train()
    mid_epoch = tmp_path / "mid"
    shutil.copytree(tmp_path / "out" / "checkpoint-1", mid_epoch / "checkpoint-1")
    drawn: list[list[int]] = []
    original = Rollouts.prompt_indices

    def recording(self, prompt_batch_index):
        drawn.append(original(self, prompt_batch_index))
        return drawn[-1]

    monkeypatch.setattr(Rollouts, "prompt_indices", recording)
    with pytest.raises(ValueError, match=r"data seed 0 -> 7 \(.* stands at prompt batch 1 of 2 "):
        trainer(mid_epoch, 3, data_seed=7).train(resume_from_checkpoint=True)
    assert drawn == []
    resumed = trainer(tmp_path / "out", 3, data_seed=7)
    resumed.train(resume_from_checkpoint=True)
    expected = torch.randperm(4, generator=torch.Generator().manual_seed(7 + 1))[:2].tolist()
    assert drawn == [expected] and resumed.state.global_step == 3


def test_prompt_order_changes_compare_the_global_prompt_count_and_the_effective_data_seed():
    from trl_sae.trainer.checkpoints.folders import prompt_order_changes

    saved = {"batch_size": 8, "num_generations": 4, "seed": 0, "data_seed": None}
    # two processes of 4 rows instead of one of 8: the same 2 prompts per step, the same order
    assert prompt_order_changes(saved, dict(saved, local_batch_size=4), 3, 16) == []
    # data_seed None means seed: 0 -> 0
    assert prompt_order_changes(saved, dict(saved, data_seed=0), 3, 16) == []
    # at an epoch boundary (8 steps per epoch) another seed is taken; the count never
    assert prompt_order_changes(saved, dict(saved, data_seed=1), 16, 16) == []
    assert prompt_order_changes(saved, dict(saved, batch_size=16), 8, 16)[0].startswith(
        "prompts per step 2 -> 4"
    )
    assert prompt_order_changes(saved, dict(saved, data_seed=1), 17, 16)[0].startswith(
        "data seed 0 -> 1 (data_seed, else seed: the checkpoint stands at prompt batch 1 of 8 of an epoch"
    )
    # the dataset's length unknown: every position is mid-epoch
    assert "stands at mid-epoch" in prompt_order_changes(saved, dict(saved, data_seed=1), 16, None)[0]
    # another train dataset length: refused mid-epoch of the saved run's shuffle, taken at its boundary
    assert prompt_order_changes(saved, saved, 3, 12, 16)[0].startswith(
        "train dataset length 16 -> 12 prompts (the checkpoint stands mid-epoch, at prompt batch 3 of 8"
    )
    assert prompt_order_changes(saved, saved, 8, 12, 16) == []
    assert prompt_order_changes(saved, saved, 3, 16, 16) == []
    assert prompt_order_changes(saved, saved, 3, 12, None) == []  # not recorded (older checkpoints)


def test_a_train_dataset_of_another_length_mid_epoch_is_refused_on_resume(run_copy, tokenizer):
    """Resuming checkpoint-2 (prompt batch 2 of 8 of a shuffle of 16 prompts) with 12 prompts would finish the
    epoch over another set of prompts, repeating some and skipping others: refused before any step."""
    steps = RecordSteps()
    config = make_config(
        run_copy.parent, output_dir=str(run_copy), max_steps=3, save_strategy="steps", save_steps=1
    )
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=config,
        train_dataset=make_dataset(12),
        processing_class=tokenizer,
        callbacks=[steps],
    )
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    assert (
        "train dataset length 16 -> 12 prompts (the checkpoint stands mid-epoch, at prompt batch 2 of 8"
        in str(error.value)
    )
    assert steps.steps == []


def test_fixed_settings_are_the_optimizer_the_seed_and_fp16():
    from trl_sae.trainer.checkpoints.folders import fixed_setting_changes

    saved = {"optim": "adamw_torch", "optim_args": None, "seed": 0, "fp16": False, "learning_rate": 1e-4}
    assert fixed_setting_changes(saved, dict(saved, learning_rate=5e-4)) == []  # re-planned, not fixed
    changes = fixed_setting_changes(saved, dict(saved, fp16=True, optim_args="momentum=0.9"))
    assert [change.split(" (")[0] for change in changes] == [
        "optim_args None -> 'momentum=0.9'",
        "fp16 False -> True",
    ]
    assert (
        fixed_setting_changes({}, {"seed": 3}) == []
    )  # a checkpoint that did not record it: nothing to compare


def test_settings_read_when_used_take_effect_at_the_resumed_step(run_copy, tokenizer, monkeypatch):
    """Every setting neither fixed by the checkpoint nor re-planned is read from the current settings when
    it is used: clipping, the KL penalty and the clip range of step 3 follow the resumed run's values."""
    import trl_sae.trainer.parts.update as update_module

    used: dict[str, list] = {"max_grad_norm": [], "cliprange": [], "kl": []}
    clip, policy_loss = update_module.clip_grad_norms, update_module.clipped_policy_loss

    def spy_clip(accelerator, groups, max_norm):
        used["max_grad_norm"].append(max_norm)
        return clip(accelerator, groups, max_norm)

    def spy_policy_loss(new, old, advantages, mask, cliprange, *args, **kwargs):
        used["cliprange"].append(cliprange)
        return policy_loss(new, old, advantages, mask, cliprange, *args, **kwargs)

    monkeypatch.setattr(update_module, "clip_grad_norms", spy_clip)
    monkeypatch.setattr(update_module, "clipped_policy_loss", spy_policy_loss)
    trainer = _trainer(run_copy, tokenizer, max_steps=3, max_grad_norm=0.25, cliprange=0.05, kl_coef=0.5)
    reference = trainer._reference_logprobs
    monkeypatch.setattr(
        trainer, "_reference_logprobs", lambda batch: used["kl"].append(1) or reference(batch)
    )
    trainer.train(resume_from_checkpoint=True)
    assert set(used["max_grad_norm"]) == {0.25} and set(used["cliprange"]) == {0.05}
    assert used["kl"] == [1]  # the run was saved with kl_coef 0: the penalty is on from step 3


def _lora_trainer(
    output_dir: Path, tokenizer, peft_config, callbacks=None, max_steps: int = 2, **overrides
) -> SAEPPOTrainer:
    config = make_config(
        output_dir.parent,
        output_dir=str(output_dir),
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=1,
        **overrides,
    )
    return SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=config,
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config,
        value_model="shared",
        callbacks=callbacks,
    )


def lora(r: int = 4, target_modules=("q_proj", "v_proj"), alpha: int = 8) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tokenizer):
    """One step of a LoRA policy with a shared critic (r=4 on q_proj, v_proj), saving checkpoint-1."""
    output_dir = tmp_path_factory.mktemp("lora") / "out"
    _lora_trainer(output_dir, tokenizer, lora(), max_steps=1).train()
    return output_dir


@pytest.fixture
def lora_copy(tmp_path, lora_run):
    output_dir = tmp_path / "out"
    shutil.copytree(lora_run, output_dir)
    return output_dir


def test_resuming_with_another_lora_set_up_names_each_difference_before_loading(lora_copy, tokenizer):
    steps = RecordSteps()
    trainer = _lora_trainer(
        lora_copy, tokenizer, lora(r=8, target_modules=("q_proj", "k_proj")), callbacks=[steps]
    )
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    message = str(error.value)
    assert "\n" not in message and "Error(s) in loading state_dict" not in message
    assert message.startswith(
        f"resume_from_checkpoint: {lora_copy / 'checkpoint-1'} was saved with another model set-up, which its "
        "weights cannot load into or would compute another function with: "
    )
    assert message.endswith(
        ". Resume with the model, LoRA and critic settings it was saved with, or start a fresh run."
    )
    differences = (
        message.split("would compute another function with: ")[1].split(". Resume with")[0].split("; ")
    )
    # The shared critic's adapter takes the same LoRA settings as the policy's.
    assert differences == [
        f"{role} LoRA {change}"
        for role in ("policy", "critic")
        for change in ("r 4 -> 8", "target_modules ['q_proj', 'v_proj'] -> ['k_proj', 'q_proj']")
    ]
    assert steps.steps == []


def test_resuming_a_lora_checkpoint_without_lora_names_the_critic_and_the_adapter(lora_copy, tokenizer):
    trainer = _trainer(lora_copy, tokenizer)  # a full policy and a separate critic
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    differences = str(error.value).split("would compute another function with: ")[1].split(". Resume with")[0]
    assert differences == (
        "policy LoRA (r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj']) -> none; "
        "critic \"a LoRA adapter and value head on the policy's base (value_model='shared')\" -> "
        "'a separate value model'"
    )


def test_a_lora_alpha_change_is_refused_on_resume(lora_copy, tokenizer):
    """Issue 28: lora_alpha scales what the saved adapter adds, so another value changes the function the
    resumed model computes; it only warned before."""
    steps = RecordSteps()
    trainer = _lora_trainer(lora_copy, tokenizer, lora(alpha=16), callbacks=[steps])
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    assert steps.steps == []
    differences = str(error.value).split("would compute another function with: ")[1].split(". Resume with")[0]
    assert differences == "policy LoRA lora_alpha 8 -> 16; critic LoRA lora_alpha 8 -> 16"


def test_an_older_checkpoint_without_a_set_up_file_still_fails_in_one_line(lora_copy, tokenizer):
    checkpoint = lora_copy / "checkpoint-1"
    (checkpoint / MODEL_SETUP_FILE).unlink(missing_ok=True)
    write_manifest(checkpoint)
    trainer = _lora_trainer(lora_copy, tokenizer, lora(r=8))
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"resume_from_checkpoint: the weights in {checkpoint} do not fit this model (")
    assert "size mismatch for" in message


# ----------------------------------------------------------------------------------------------------
# The recipe path: `trl-sae train` and examples/sae_ppo_math.py
# ----------------------------------------------------------------------------------------------------
RECIPE = """\
model_name_or_path: {model}
dataset_name: {data}
reward_funcs: [format_reward]
use_peft: false
advantage_estimator: sae
num_generations: 2
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
response_length: 4
learning_rate: 1.0e-3
critic_learning_rate: 1.0e-3
temperature: 1.0
max_steps: 2
save_steps: 1
save_total_limit: 5
logging_steps: 1
bf16: false
use_cpu: true
report_to: none
disable_tqdm: true
seed: 0
"""


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, tokenizer):
    """``base.yaml`` trained for 2 steps with a checkpoint after each, as in the issue's reproduction."""
    root = tmp_path_factory.mktemp("recipe")
    model = root / "tiny"
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = root / "math.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    recipe = root / "base.yaml"
    recipe.write_text(RECIPE.format(model=model, data=data))
    output_dir = root / "ck"
    run_recipe(*parse_recipe([str(recipe), "--output_dir", str(output_dir)]))
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    return recipe, output_dir


@pytest.fixture
def recipe_copy(tmp_path, recipe_run):
    output_dir = tmp_path / "ck"
    shutil.copytree(recipe_run[1], output_dir)
    return recipe_run[0], output_dir


def test_recipe_resumes_at_step_3_without_rewriting_earlier_checkpoints(capsys, recipe_copy):
    recipe, ck = recipe_copy
    earlier = {name: snapshot(ck / name) for name in ("checkpoint-1", "checkpoint-2")}
    steps = RecordSteps()
    argv = [str(recipe), "--output_dir", str(ck), "--max_steps", "3"]
    run_recipe(
        *parse_recipe([*argv, "--resume_from_checkpoint", str(ck / "checkpoint-2")]), callbacks=[steps]
    )
    assert steps.steps == [3]
    assert episodes_of(ck / "checkpoint-3") == [4, 8, 12]  # not 4, 8, 4, 8, 12: one run, continued
    assert {name: snapshot(ck / name) for name in earlier} == earlier

    # `trl-sae train ... --resume_from_checkpoint true` picks the newest checkpoint (checkpoint-3).
    third = snapshot(ck / "checkpoint-3")
    argv[-1] = "4"
    assert main(["train", *argv, "--resume_from_checkpoint", "true"]) == 0, capsys.readouterr().err
    assert episodes_of(ck / "checkpoint-4") == [4, 8, 12, 16]
    assert snapshot(ck / "checkpoint-3") == third


def test_cli_refuses_a_fresh_run_over_old_checkpoints_in_one_line(capsys, recipe_copy):
    recipe, ck = recipe_copy
    before = snapshot(ck)
    assert main(["train", str(recipe), "--output_dir", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "Loading weights" not in err  # refused before loading the model
    error = err.strip().splitlines()[0]
    assert error.startswith("trl-sae train: error: output_dir ")
    assert "--resume_from_checkpoint true" in error and "--overwrite_output_dir true" in error
    assert snapshot(ck) == before


def test_example_script_resumes_too(capsys, recipe_copy):
    recipe, ck = recipe_copy
    earlier = snapshot(ck / "checkpoint-1")
    spec = importlib.util.spec_from_file_location("sae_ppo_math", EXAMPLES / "sae_ppo_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(
        [
            "--config",
            str(recipe),
            "--output_dir",
            str(ck),
            "--max_steps",
            "3",
            "--resume_from_checkpoint",
            "True",
        ]
    )
    assert episodes_of(ck / "checkpoint-3") == [4, 8, 12]
    assert snapshot(ck / "checkpoint-1") == earlier


# ----------------------------------------------------------------------------------------------------
# Two processes (gloo): one manifest lists every rank's RNG file; every rank takes the same decision
# ----------------------------------------------------------------------------------------------------
TWO_RANK_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
from datasets import Dataset
from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

out, rank = sys.argv[1], int(os.environ["RANK"])
tokenizer = build_char_tokenizer()

def vowels(prompts, completions, completion_ids, **columns):
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]

def trainer():
    config = SAEPPOConfig(
        output_dir=os.path.join(out, "ck"), per_device_train_batch_size=4, num_generations=2, response_length=6,
        max_steps=2, learning_rate=1e-3, critic_learning_rate=1e-3, temperature=1.0, report_to="none",
        disable_tqdm=True, save_strategy="steps", save_steps=1, use_cpu=True, seed=0, stop_token=None,
    )
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]})
    return SAEPPOTrainer(model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=vowels, args=config,
                         train_dataset=dataset, processing_class=tokenizer)

def checksum(t):
    return float(sum(p.double().sum() for p in t.accelerator.unwrap_model(t.model).parameters()))

first = trainer()
first.train()
result = {"straight": checksum(first)}
try:
    trainer().train()  # fresh run over the checkpoints: every rank must raise, none may hang
except ValueError as error:
    result["refused"] = str(error)
first.accelerator.wait_for_everyone()
if rank == 0:  # damage rank 1's RNG state in the newest checkpoint
    path = os.path.join(out, "ck", "checkpoint-2", "accelerate_state", "random_states_1.pkl")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
first.accelerator.wait_for_everyone()
resumed = trainer()
resumed.train(resume_from_checkpoint=True)
result["resumed"] = checksum(resumed)
result["rewards"] = [[e["reward/mean"] for e in t.state.log_history if "reward/mean" in e] for t in (first, resumed)]
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump(result, handle)
"""


@in_the_ddp_launch("checkpointing_fall_back")
def test_two_processes_verify_and_fall_back_together(ddp_launch):
    tmp_path = ddp_launch / "checkpointing_fall_back"  # the scenario's folder of the shared launch
    manifest = json.loads((tmp_path / "ck" / "checkpoint-1" / MANIFEST_NAME).read_text())["files"]
    assert {"accelerate_state/random_states_0.pkl", "accelerate_state/random_states_1.pkl"} <= set(manifest)
    stderr = (ddp_launch / "stderr.txt").read_text()
    assert "checkpoint-2: accelerate_state/random_states_1.pkl is " in stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert "--overwrite_output_dir true" in r["refused"]
        assert r["resumed"] == pytest.approx(
            r["straight"], rel=1e-9
        )  # fell back to checkpoint-1, redid step 2
        assert r["rewards"][1] == pytest.approx(r["rewards"][0])
    assert checkpoint_problems(tmp_path / "ck" / "checkpoint-2") == []


DISK_FULL_ON_RANK_0 = """
import errno, json, os, sys
import torch
torch.set_num_threads(1)
from datasets import Dataset
from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

out = sys.argv[1]
rank = int(os.environ["RANK"])
save = torch.save

def disk_full_in_checkpoint_2(obj, f, *args, **kwargs):  # rank 0's disk fills while it writes checkpoint-2
    if "tmp-checkpoint-2" in str(f):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))
    return save(obj, f, *args, **kwargs)

if rank == 0:
    torch.save = disk_full_in_checkpoint_2
tokenizer = build_char_tokenizer()
config = SAEPPOConfig(
    output_dir=os.path.join(out, "run"), per_device_train_batch_size=4, num_generations=2, response_length=4,
    max_steps=3, learning_rate=1e-3, critic_learning_rate=1e-3, report_to="none", disable_tqdm=True,
    save_strategy="steps", save_steps=1, use_cpu=True, seed=0, stop_token=None,
)
trainer = SAEPPOTrainer(
    model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=lambda completions, **kw: [0.5] * len(completions),
    args=config, train_dataset=Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]}),
    processing_class=tokenizer,
)
try:
    trainer.train()
except Exception as error:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"error": type(error).__name__, "message": str(error), "step": trainer.state.global_step}, handle)
    torch.distributed.barrier()  # both outcomes are on disk before either process ends
    raise
"""


@pytest.mark.slow  # one 2-process launch: ~30-60 s on 2 shared cores
@pytest.mark.timeout(600)
def test_a_save_failing_on_rank_0_ends_both_ranks_with_one_line_each(tmp_path):
    """Rank 0's disk fills while it writes checkpoint-2. Rank 1 used to wait at the save's barrier until the
    launcher killed it; now both stop at once: rank 0 with the disk-full line naming the output_dir, rank 1
    saying rank 0 failed to save. checkpoint-1 is intact and nothing of checkpoint-2 is left."""
    from tests.test_distributed import launch_env, run_launch, two_rank_command

    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL_ON_RANK_0)
    result = run_launch(two_rank_command(script, str(tmp_path)), launch_env(), timeout=300)
    assert result.returncode != 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    run = tmp_path / "run"
    assert ranks[0]["error"] == "CheckpointDiskFullError" and ranks[0]["step"] == 2
    assert ranks[0]["message"].startswith(
        f"Saving checkpoint-2 failed: the disk holding output_dir {run} is full"
    )
    assert "checkpoint-1, the last complete checkpoint, is kept" in ranks[0]["message"]
    assert ranks[1]["error"] == "SaveFailedOnAnotherProcessError" and ranks[1]["step"] == 2
    assert ranks[1]["message"].startswith("rank 0 failed to save, stopping (writing tmp-checkpoint-2;")
    assert all("\n" not in rank["message"] for rank in ranks)
    assert "rank 0 failed to save, stopping" in result.stderr or "Saving checkpoint-2 failed" in result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1"]
    assert checkpoint_problems(run / "checkpoint-1") == []


# ----------------------------------------------------------------------------------------------------
# A checkpoint is explicit objects (issue 33): saved from and loaded into what it is given, not the trainer
# ----------------------------------------------------------------------------------------------------
def test_a_checkpoint_saves_the_objects_it_is_given(tmp_path, tokenizer):
    from trl_sae.trainer.checkpoints.state import CheckpointState, save_checkpoint
    from trl_sae.trainer.trl_base import OnlineTrainerState

    trainer = _trainer(tmp_path / "out", tokenizer)
    progress = OnlineTrainerState(global_step=7, episode=56, log_history=[{"reward/mean": 0.25, "step": 7}])
    written: list[str] = []

    def save_model(folder: str) -> None:
        written.append(folder)
        trainer.save_model(folder, _internal_call=True)

    state = CheckpointState(trainer.accelerator, trainer.model, trainer.lr_scheduler, progress, trainer.args)
    folder = save_checkpoint(state, save_model)
    assert folder == str(tmp_path / "out" / "checkpoint-7")
    assert written == [str(tmp_path / "out" / "tmp-checkpoint-7")]  # staged, then renamed into place
    verify_checkpoint(folder)
    saved = json.loads((Path(folder) / "trainer_state.json").read_text())
    assert (saved["global_step"], saved["episode"], saved["log_history"]) == (7, 56, progress.log_history)
    assert trainer.state.global_step == 0  # the trainer's own state was not what was saved


def test_a_checkpoint_loads_into_the_objects_it_is_given(run_copy, two_step_run, tokenizer):
    from trl_sae.trainer.checkpoints.state import CheckpointState, load_checkpoint
    from trl_sae.trainer.trl_base import OnlineTrainerState

    _, final_weights, rewards = two_step_run
    trainer = _trainer(run_copy, tokenizer, max_steps=4)
    progress = OnlineTrainerState()
    state = CheckpointState(trainer.accelerator, trainer.model, trainer.lr_scheduler, progress, trainer.args)
    load_checkpoint(state, str(run_copy / "checkpoint-2"))
    assert (progress.global_step, progress.episode) == (2, 2 * trainer.args.batch_size)
    assert [e["reward/mean"] for e in progress.log_history if "reward/mean" in e] == rewards
    assert trainer.state.global_step == 0 and trainer.state.log_history == []
    loaded = parameters_of(trainer.accelerator.unwrap_model(trainer.model))
    assert loaded.keys() == final_weights.keys()
    assert all(torch.equal(loaded[name], final_weights[name]) for name in loaded)
