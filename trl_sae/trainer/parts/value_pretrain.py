"""Value pretraining (VC-PPO): the critic fitted alone on the initial policy's rollouts before PPO.

Before the first policy update of a fresh run (``SAEPPOConfig.value_pretrain_rollouts > 0``):

1. **Sample** ``value_pretrain_held_out`` completions, then ``value_pretrain_rollouts``, with the trainer's own
   :class:`~trl_sae.trainer.parts.rollout.Rollouts` (vLLM or transformers, one rollout batch at a time), scored and
   valued as a PPO step's batch is. Their prompts come from an order of their own (:func:`pretrain_prompts`):
   the held-out prompts first and never in the fitting set; the torch RNG is forked and vLLM gets its own seed
   stream, so the PPO steps afterwards draw the prompts and samples a run without pretraining draws. Targets
   are lambda = 1 returns of the trainer's token rewards (the KL term and reward whitening included) at the
   configured ``gamma``: a discounted sum of rewards, independent of the critic being fitted.
2. **Fit** for at most ``value_pretrain_epochs`` passes over the fitting rollouts, through the trainer's own
   :class:`~trl_sae.trainer.parts.update.PPOUpdate` (its mini-batches, micro-batches, gradient synchronisation and
   clipping) with the actor off. The value loss is the plain squared error: PPO's value clipping keeps the
   critic near the values it had when the rollout was sampled, which here would pin every epoch to the
   initial critic, so ``cliprange_value`` is lifted (and ``vf_coef`` set to 1) for these updates only. The
   critic's learning rate is ``value_pretrain_learning_rate``, constant; the AdamW state it builds is dropped
   afterwards, so PPO starts on the pretrained critic exactly as a run that loads it.
3. After each epoch, on the held-out rollouts (over every completion token of every process): **R^2**,
   ``1 - E[(R - V)^2] / Var(R)``, logged as ``value_pretrain/r2_held_out``, and explained variance (as
   ``critic/explained_variance``), ``value_pretrain/explained_variance_held_out``, with
   ``value_pretrain/loss`` and ``value_pretrain/epoch``. The run stops after ``value_pretrain_patience``
   epochs without a rise of R^2 of more than ``value_pretrain_min_delta``, and keeps the epoch with the best
   R^2 (epoch 0, the critic as built, included). R^2 and not explained variance decides, because
   explained variance ignores an offset of every value: a critic that ranks the states well but values them
   all 0.28 too high (as one SmolLM2 fit ended an epoch) has EV 0.19 and R^2 below 0.

Everything is written under ``<output_dir>/value_pretrain/``: the sampled rollouts (``rollouts/rank-<r>.pt``,
once sampled), after each epoch ``progress-epoch-<k>/`` (the critic, the best critic, the optimizer, the
history; staged and renamed, so an interrupted save leaves the previous one), and at the end
``critic.safetensors`` and ``value_pretrain.json`` (the summary, written last: only a finished pretraining
has one). ``resume_from_checkpoint=True`` before the first PPO checkpoint continues an interrupted
pretraining from its newest epoch; ``value_pretrain_path`` loads a finished one in another run.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from trl_sae.core.advantages import gae_advantages
from trl_sae.trainer.checkpoints.folders import model_setup, sorted_checkpoints
from trl_sae.trainer.critics.policy_and_critic import critic_values
from trl_sae.trainer.parts.metrics import critic_fit_scores
from trl_sae.trainer.rollout_batch import RolloutBatch

__all__ = [
    "PRETRAIN_DIR",
    "StepPhases",
    "ValuePretraining",
    "check_value_pretrain_setup",
    "continues_value_pretraining",
    "critic_state",
    "prepare_critic",
    "pretrain_prompts",
]

PRETRAIN_DIR = "value_pretrain"
SUMMARY_FILE = "value_pretrain.json"
CRITIC_FILE = "critic.safetensors"
ROLLOUTS_DIR = "rollouts"
PROGRESS_PREFIX = "progress-epoch-"
# The fields a rollout keeps on disk: what the fit and the held-out measurement read.
ROLLOUT_FIELDS = (
    "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "entropies",
    "is_truncated", "scores", "values", "returns",
)  # fmt: skip
# What a pretrained critic must share with the run that loads it (model_setup's sections).
CRITIC_SECTIONS = ("policy", "critic", "critic model", "critic LoRA")
# The settings an interrupted pretraining must be resumed with (beyond the value_pretrain_* ones).
RESUME_SETTINGS = (
    "seed", "data_seed", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
    "world_size", "num_mini_batches", "critic_learning_rate", "gamma", "kl_coef", "whiten_rewards",
    "response_length", "temperature",
)  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Set-up checks (the trainer's __init__) and where a run starts
# ----------------------------------------------------------------------------------------------------
def check_value_pretrain_setup(trainer: Any) -> None:
    """Refuse, when the trainer is built, value-pretraining settings that the batch sizes, the dataset, the
    distributed set-up or the critic rule out (the config checked what it alone decides)."""
    args = trainer.args
    if not args.value_pretraining and args.value_pretrain_path is None:
        return
    if trainer.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        name = "value_pretrain_rollouts" if args.value_pretraining else "value_pretrain_path"
        raise ValueError(
            f"SAEPPOConfig.{name}: value pretraining runs on one process or under DDP; "
            f"{trainer.accelerator.distributed_type} is not supported yet. Pretrain under DDP and load the "
            "critic in a DDP run, or drop it."
        )
    if args.value_pretrain_path is not None:
        load_summary(args.value_pretrain_path, trainer.accelerator.unwrap_model(trainer.model))
        return
    for name in ("value_pretrain_rollouts", "value_pretrain_held_out"):
        if getattr(args, name) % args.batch_size:
            raise ValueError(
                f"SAEPPOConfig.{name}: {getattr(args, name)} is not a multiple of the rollout batch, "
                f"batch_size={args.batch_size} completions (per_device_train_batch_size x "
                f"gradient_accumulation_steps x {args.world_size} process(es)); pick a multiple."
            )
    held_prompts = args.value_pretrain_held_out // args.num_generations
    pool = trainer.train_dataset_len - held_prompts
    if pool < trainer.global_prompts_per_step:
        raise ValueError(
            f"SAEPPOConfig.value_pretrain_held_out: {args.value_pretrain_held_out} completions take {held_prompts} "
            f"of the {trainer.train_dataset_len} prompts, leaving {pool} to fit on, fewer than one rollout batch "
            f"needs ({trainer.global_prompts_per_step}); lower it or add prompts."
        )


def continues_value_pretraining(args: Any, resume: str | bool | None) -> bool:
    """Whether ``resume=True`` finds no PPO checkpoint but a value pretraining of this run to continue (or
    a finished one to load): the run then starts its PPO steps fresh."""
    if resume is not True or not args.value_pretraining:
        return False
    folder = Path(args.output_dir) / PRETRAIN_DIR
    return not sorted_checkpoints(args.output_dir) and folder.is_dir()


def prepare_critic(
    trainer: Any, pretraining: ValuePretraining, resume: bool = False
) -> dict[str, Any] | None:
    """At the start of a fresh run: load the critic of ``value_pretrain_path``, or run ``pretraining``
    (continuing an interrupted one with ``resume``); the pretraining's summary (None without either). Every
    process calls it."""
    args = trainer.args
    if args.value_pretrain_path is not None:
        return load_pretrained_critic(trainer, args.value_pretrain_path)
    if args.value_pretraining:
        return pretraining.run(resume)
    return None


# ----------------------------------------------------------------------------------------------------
# The critic's weights
# ----------------------------------------------------------------------------------------------------
def critic_state(wrapper: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The critic's trainable parameters by their name in the policy-and-critic ``wrapper`` (unwrapped): a
    separate critic's, the shared-base critic's adapter and value head, or the head critic's value head."""
    ids = {id(p) for p in wrapper.critic_parameters()}
    return {name: p for name, p in wrapper.named_parameters() if id(p) in ids}


def _cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().to("cpu", copy=True).contiguous() for name, value in state.items()}


@torch.no_grad()
def _load_state(wrapper: torch.nn.Module, saved: dict[str, torch.Tensor], source: str) -> None:
    own = critic_state(wrapper)
    wrong = sorted(set(own) ^ set(saved)) or [n for n in own if own[n].shape != saved[n].shape]
    if wrong:
        raise ValueError(
            f"SAEPPOConfig.value_pretrain_path: the critic in {source} does not fit this run's critic (first "
            f"mismatched parameter: {wrong[0]}); pretrain with the same model, critic and LoRA settings."
        )
    for name, parameter in own.items():
        parameter.copy_(saved[name].to(parameter.device, parameter.dtype))


def critic_identity(wrapper: torch.nn.Module) -> dict[str, Any]:
    """What a pretrained critic must share with the run that loads it: the base model, the critic's kind
    (the head critic's names its layer), the critic model and its LoRA."""
    setup = model_setup(wrapper)
    return {section: setup.get(section) for section in CRITIC_SECTIONS}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_summary(path: str | os.PathLike, wrapper: torch.nn.Module) -> dict[str, Any]:
    """The summary of the finished pretraining in ``path``, after checking it is complete and that its critic
    is this run's kind of critic (a ValueError naming ``value_pretrain_path`` otherwise)."""
    folder = Path(path)
    summary_file, critic_file = folder / SUMMARY_FILE, folder / CRITIC_FILE
    if not (summary_file.is_file() and critic_file.is_file()):
        raise ValueError(
            f"SAEPPOConfig.value_pretrain_path: {folder} holds no finished value pretraining (needs "
            f"{SUMMARY_FILE} and {CRITIC_FILE}); pass an earlier run's <output_dir>/{PRETRAIN_DIR}."
        )
    summary = json.loads(summary_file.read_text())
    if summary.get("critic_sha256") != _sha256(critic_file):
        raise ValueError(
            f"SAEPPOConfig.value_pretrain_path: {critic_file} is not the critic {SUMMARY_FILE} describes (its "
            "checksum differs: a later write or a damaged copy); pretrain again."
        )
    current = critic_identity(wrapper)
    saved = summary.get("critic_identity", {})
    differences = [
        f"{section} {saved.get(section)!r} -> {current[section]!r}"
        for section in CRITIC_SECTIONS
        if saved.get(section) != current[section]
    ]
    if differences:
        raise ValueError(
            f"SAEPPOConfig.value_pretrain_path: the critic in {folder} was pretrained for another critic "
            f"({differences[0]}); load it with the same model, value_model, value_head_layer and LoRA settings."
        )
    return summary


def load_pretrained_critic(trainer: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Load the finished pretraining in ``path`` into the trainer's critic; its summary."""
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    summary = load_summary(path, wrapper)
    _load_state(wrapper, load_file(str(Path(path) / CRITIC_FILE)), str(path))
    return summary


# ----------------------------------------------------------------------------------------------------
# Prompts and rollouts
# ----------------------------------------------------------------------------------------------------
def _stable_seed(*parts: Any) -> int:
    key = "/".join(["trl-sae/value-pretrain", *map(str, parts)]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2**63


def pretrain_prompts(
    num_prompts: int, held_out_prompts: int, per_batch: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The pretraining prompt order: ``(held-out prompts, fitting pool's reshuffle for each pass)``.

    A permutation of the ``num_prompts`` dataset rows seeded from ``seed`` alone (not the PPO order): its
    first ``held_out_prompts`` rows are held out, the rest the pool the fitting batches of ``per_batch`` prompts
    come from, a fresh shuffle of the pool for each pass over it (see :func:`fitting_batch`).
    """
    generator = torch.Generator().manual_seed(_stable_seed(seed, "order"))
    order = torch.randperm(num_prompts, generator=generator)
    return order[:held_out_prompts], order[held_out_prompts:]


def fitting_batch(pool: torch.Tensor, batch_index: int, per_batch: int, seed: int) -> torch.Tensor:
    """The ``per_batch`` prompts (over every process) of fitting batch ``batch_index``: passes over the pool,
    each in a shuffle of its own (a pass's remainder shorter than a batch is skipped, as a PPO epoch's)."""
    per_pass = len(pool) // per_batch
    epoch, position = divmod(batch_index, per_pass)
    generator = torch.Generator().manual_seed(_stable_seed(seed, "pass", epoch))
    shuffled = pool[torch.randperm(len(pool), generator=generator)]
    return shuffled[position * per_batch : (position + 1) * per_batch]


def _concatenate(parts: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Rollout dicts of :data:`ROLLOUT_FIELDS` as one: prompts left-padded, completions right-padded."""
    prompt_width = max(part["prompt_ids"].shape[1] for part in parts)
    width = max(part["completion_ids"].shape[1] for part in parts)
    joined = {}
    for name in ROLLOUT_FIELDS:
        pieces = []
        for part in parts:
            value = part[name]
            if name.startswith("prompt_"):
                fill = pad_token_id if name == "prompt_ids" else 0
                value = torch.nn.functional.pad(value, (prompt_width - value.shape[1], 0), value=fill)
            elif value.dim() == 2:
                fill = pad_token_id if name == "completion_ids" else 0
                value = torch.nn.functional.pad(value, (0, width - value.shape[1]), value=fill)
            pieces.append(value)
        joined[name] = torch.cat(pieces)
    return joined


def _as_batch(rollouts: dict[str, torch.Tensor], device: torch.device) -> RolloutBatch:
    return RolloutBatch(prompts=[], columns={}, **{k: v.to(device) for k, v in rollouts.items()})


def _write_atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename over ``path``: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f"tmp-{path.name}")
    write(tmp)
    os.replace(tmp, path)


class StepPhases(NamedTuple):
    """The trainer's step phases between sampling and the update, as its ``train_step`` runs them (the
    trainer passes its own, subclass overrides included)."""

    shared_prefix: Callable[[], AbstractContextManager[Any]]
    compute_values: Callable[[RolloutBatch], None]
    compute_boundaries: Callable[[RolloutBatch], None]
    compute_advantages: Callable[[RolloutBatch], None]


class ValuePretraining:
    """One run's value pretraining on ``trainer`` (see the module doc); :meth:`run` does all of it.

    Args:
        trainer: the :class:`~trl_sae.SAEPPOTrainer` (its args, accelerator, model, optimizer, rollouts,
            update part, dataset and ``log``).
        phases: its step phases that value and reward a sampled batch.
    """

    def __init__(self, trainer: Any, phases: StepPhases) -> None:
        self.trainer = trainer
        self.phases = phases
        self.args = trainer.args
        self.accelerator = trainer.accelerator
        self.wrapper = self.accelerator.unwrap_model(trainer.model)
        self.folder = Path(self.args.output_dir) / PRETRAIN_DIR
        self.rank = self.accelerator.process_index
        self.show_progress = self.accelerator.is_main_process and not self.args.disable_tqdm
        self.seconds = {"sampling": 0.0, "fitting": 0.0}

    # -- the whole phase -------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict[str, Any]:
        if resume and (self.folder / SUMMARY_FILE).is_file():
            return load_pretrained_critic(self.trainer, self.folder)  # finished before the run stopped
        if not resume:
            self._clear_earlier()
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the PPO run's samples stay those of a run without it
            fit, held = self.rollouts(resume)
            summary = self._fit(fit, held, resume)
        return summary

    def _clear_earlier(self) -> None:
        exists = self.folder.exists()  # on every process before any removes it, so all raise together
        self.accelerator.wait_for_everyone()
        if exists and not self.args.overwrite_output_dir:
            raise ValueError(
                f"SAEPPOConfig.value_pretrain_rollouts: {self.folder} holds an earlier value pretraining; "
                "continue it with resume_from_checkpoint=True, load it in another run with "
                "value_pretrain_path, or replace it with overwrite_output_dir=True."
            )
        if exists and self.accelerator.is_main_process:
            shutil.rmtree(self.folder)
        self.accelerator.wait_for_everyone()

    # -- sampling --------------------------------------------------------------------------------------
    def rollouts(self, resume: bool) -> tuple[RolloutBatch, RolloutBatch]:
        """This process's fitting and held-out rollouts (``value_pretrain_rollouts`` and
        ``value_pretrain_held_out`` split over the processes), scored and valued by the step phases: sampled
        from the current policy and saved under ``<output_dir>/value_pretrain/rollouts/`` (a bank the fit can
        be rerun from), or read back from there when ``resume`` and every process has its file; their
        returns are lambda = 1 returns. A collective."""
        path = self.folder / ROLLOUTS_DIR / f"rank-{self.rank}.pt"
        have = torch.tensor([float(resume and path.is_file())], device=self.accelerator.device)
        if self.accelerator.reduce(have, reduction="sum").item() == self.accelerator.num_processes:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            self.seconds["sampling"] = float(saved.pop("seconds").item())
        else:
            start = time.perf_counter()
            saved = self._sample_all()
            self.seconds["sampling"] = time.perf_counter() - start
            path.parent.mkdir(parents=True, exist_ok=True)
            seconds = torch.tensor(self.seconds["sampling"])
            _write_atomic(path, lambda tmp: torch.save({**saved, "seconds": seconds}, tmp))
            self.accelerator.wait_for_everyone()
        device = self.accelerator.device
        fit = {k[4:]: v for k, v in saved.items() if k.startswith("fit/")}
        held = {k[5:]: v for k, v in saved.items() if k.startswith("held/")}
        return _as_batch(fit, device), _as_batch(held, device)

    def _sample_all(self) -> dict[str, torch.Tensor]:
        args, trainer = self.args, self.trainer
        per_batch = trainer.global_prompts_per_step
        local = trainer.local_prompts_per_step
        seed = args.data_seed if args.data_seed is not None else args.seed
        held_prompts, pool = pretrain_prompts(
            trainer.train_dataset_len, args.value_pretrain_held_out // args.num_generations, per_batch, seed
        )
        batches = [held_prompts[i : i + per_batch] for i in range(0, len(held_prompts), per_batch)]
        num_held = len(batches)
        num_fit = args.value_pretrain_rollouts // args.batch_size
        batches += [fitting_batch(pool, index, per_batch, seed) for index in range(num_fit)]
        parts = []
        bar = tqdm(total=len(batches), desc="value pretraining: sampling", disable=not self.show_progress)
        for call, prompts in enumerate(batches):
            rows = prompts[self.rank * local : (self.rank + 1) * local].tolist()
            parts.append(self._sample_batch(rows, call))
            bar.update(1)
        bar.close()
        pad = trainer.processing_class.pad_token_id
        held = _concatenate(parts[:num_held], pad)
        fit = _concatenate(parts[num_held:], pad)
        return {**{f"fit/{k}": v for k, v in fit.items()}, **{f"held/{k}": v for k, v in held.items()}}

    def _sample_batch(self, rows: list[int], call: int) -> dict[str, torch.Tensor]:
        """One rollout batch of dataset ``rows`` as a PPO step makes it (sampled, scored, valued, rewarded),
        with lambda = 1 returns; on the CPU."""
        trainer, rollouts, phases = self.trainer, self.trainer.rollouts, self.phases
        torch.manual_seed(_stable_seed(self.args.seed, "sample", call, self.rank))
        prompt_batch = rollouts.collate([trainer.train_dataset[i] for i in rows])
        prompt_batch["vllm_seed_stream"] = ("value_pretrain", call)
        # As train_step without filter_groups (these batches are never filtered: the critic fits every group).
        with phases.shared_prefix():
            batch = rollouts.sample(prompt_batch)
            rollouts.score(batch, synchronize=True)
            with phases.shared_prefix():
                phases.compute_values(batch)
        phases.compute_boundaries(batch)
        phases.compute_advantages(batch)  # the token rewards, as the PPO step's (KL term, whitening)
        zeros = torch.zeros_like(batch.token_rewards)
        _, batch.returns = gae_advantages(
            batch.token_rewards, zeros, batch.mask, lam=1.0, gamma=self.args.gamma
        )
        return {name: getattr(batch, name).detach().cpu() for name in ROLLOUT_FIELDS}

    # -- fitting ---------------------------------------------------------------------------------------
    def _update(self) -> Any:
        """The trainer's update part, critic only, with the plain squared error (see the module doc)."""
        update = copy.copy(self.trainer.ppo_update)
        settings = copy.copy(self.args)
        settings.num_ppo_epochs = 1
        settings.cliprange_value = math.inf
        settings.vf_coef = 1.0
        settings.top_entropy_quantile = 1.0  # the policy's token masks are not used
        settings.positive_nll_coef = 0.0
        update.args = settings
        update.trains_actor = lambda step: False
        return update

    def _critic_groups(self) -> list[dict[str, Any]]:
        critic = {id(p) for p in self.wrapper.critic_parameters()}
        return [g for g in self.trainer.optimizer.param_groups if all(id(p) in critic for p in g["params"])]

    @torch.no_grad()
    def held_out_values(self, batch: RolloutBatch) -> torch.Tensor:
        """The critic's values of ``batch``'s states, as the step's value pass computes them."""
        values = critic_values(
            self.wrapper,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.completion_ids,
            batch.completion_mask,
            chunk_size=self.args.local_rollout_forward_batch_size,
            autocast=self.accelerator.autocast,
        )
        return torch.where(batch.mask, values, torch.zeros((), device=batch.mask.device))

    def _fit(self, fit: RolloutBatch, held: RolloutBatch, resume: bool) -> dict[str, Any]:
        args, accelerator, optimizer = self.args, self.accelerator, self.trainer.optimizer
        progress = self._latest_progress() if resume else None
        groups = self._critic_groups()
        rates = [group["lr"] for group in groups]  # before a resumed optimizer state brings its own
        if progress is None:
            # Epoch 0: the critic as built, as the held-out rollouts' own value pass measured it.
            ev, r2 = critic_fit_scores(accelerator, held.values, held.returns, held.mask)
            progress = {"epoch": 0, "explained_variance": [ev], "r2": [r2], "loss": [None], "best_epoch": 0}
            best = _cpu_copy(critic_state(self.wrapper))
            self._log(0, ev, r2, None)
        else:
            best = self._restore(progress)
        lr = args.value_pretrain_learning_rate or args.critic_learning_rate
        update = self._update()
        # The bar counts optimizer steps (an epoch of a 1,024-rollout bank is minutes on a CPU); the postfix
        # says the epoch and its held-out explained variance.
        steps_per_epoch = math.ceil(fit.completion_ids.shape[0] / args.local_mini_batch_size)
        bar = tqdm(
            total=args.value_pretrain_epochs * steps_per_epoch,
            initial=progress["epoch"] * steps_per_epoch,
            desc="value pretraining",
            unit="batch",
            disable=not self.show_progress,
        )
        update.on_mini_batch = lambda: bar.update(1)
        bar.set_postfix(
            epoch=progress["epoch"],
            r2_held_out=f"{progress['r2'][-1]:.4f}",
            ev_held_out=f"{progress['explained_variance'][-1]:.4f}",
        )
        start = time.perf_counter() - progress.get("fitting_seconds", 0.0)
        try:
            for group in groups:
                group["lr"] = lr
            while progress["epoch"] < args.value_pretrain_epochs and not self._plateaued(progress):
                epoch = progress["epoch"] + 1
                torch.manual_seed(_stable_seed(args.seed, "fit", epoch, self.rank))  # this epoch's shuffle
                stats = update.run(fit, step=0)
                loss = float(accelerator.reduce(stats["loss/value"].detach(), reduction="mean").item())
                ev, r2 = critic_fit_scores(accelerator, self.held_out_values(held), held.returns, held.mask)
                progress["epoch"] = epoch
                progress["explained_variance"].append(ev)
                progress["r2"].append(r2)
                progress["loss"].append(loss)
                # Kept by R^2, not by explained variance: EV ignores an offset of every value, and a fit at a
                # high learning rate can end an epoch well ranked but shifted (SmolLM2: EV 0.19, values +0.28).
                if r2 > progress["r2"][progress["best_epoch"]] + args.value_pretrain_min_delta:
                    progress["best_epoch"] = epoch
                    best = _cpu_copy(critic_state(self.wrapper))
                progress["fitting_seconds"] = time.perf_counter() - start
                self._save_progress(progress, best)
                self._log(epoch, ev, r2, loss)
                bar.n = epoch * steps_per_epoch  # exact even when an overridden update skips the hook
                bar.set_postfix(
                    epoch=epoch, r2_held_out=f"{r2:.4f}", ev_held_out=f"{ev:.4f}", best=progress["best_epoch"]
                )
        finally:
            for group, rate in zip(groups, rates):
                group["lr"] = rate
            bar.close()
        _load_state(self.wrapper, best, "the best epoch")
        for parameter in self.wrapper.critic_parameters():  # PPO's AdamW starts afresh on the critic
            optimizer.state.pop(parameter, None)
        self.seconds["fitting"] = progress.get("fitting_seconds", 0.0)
        return self._finish(progress, best)

    def _plateaued(self, progress: dict[str, Any]) -> bool:
        patience = self.args.value_pretrain_patience
        return patience is not None and progress["epoch"] - progress["best_epoch"] >= patience

    def _log(self, epoch: int, ev: float, r2: float, loss: float | None) -> None:
        if self.args.logging_strategy == "no":
            return
        logs = {
            "value_pretrain/epoch": float(epoch),
            "value_pretrain/explained_variance_held_out": ev,
            "value_pretrain/r2_held_out": r2,
        }
        if loss is not None:
            logs["value_pretrain/loss"] = loss
        self.trainer.log(logs)

    # -- saving and resuming ---------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        names = [name for name in vars(self.args) if name.startswith("value_pretrain_")] + list(
            RESUME_SETTINGS
        )
        return {name: getattr(self.args, name) for name in sorted(names)}

    def _save_progress(self, progress: dict[str, Any], best: dict[str, torch.Tensor]) -> None:
        """``progress-epoch-<k>/`` (staged, renamed; older ones removed after), on the main process."""
        accelerator = self.accelerator
        if accelerator.is_main_process:
            name = f"{PROGRESS_PREFIX}{progress['epoch']}"
            staging = self.folder / f"tmp-{name}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            save_file(_cpu_copy(critic_state(self.wrapper)), str(staging / CRITIC_FILE))
            save_file(best, str(staging / "best_critic.safetensors"))
            torch.save(self.trainer.optimizer.state_dict(), staging / "optimizer.pt")
            content = {**progress, "settings": self._settings()}
            (staging / "progress.json").write_text(json.dumps(content, indent=2))
            final = self.folder / name
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            for older in self.folder.glob(f"{PROGRESS_PREFIX}*"):
                if older != final:
                    shutil.rmtree(older, ignore_errors=True)
        accelerator.wait_for_everyone()

    def _latest_progress(self) -> dict[str, Any] | None:
        folders = sorted(
            (p for p in self.folder.glob(f"{PROGRESS_PREFIX}*") if (p / "progress.json").is_file()),
            key=lambda p: int(p.name[len(PROGRESS_PREFIX) :]),
        )
        if not folders:
            return None
        progress = json.loads((folders[-1] / "progress.json").read_text())
        saved, current = progress.pop("settings"), json.loads(json.dumps(self._settings()))
        changed = [f"{k} {saved.get(k)!r} -> {current[k]!r}" for k in current if saved.get(k) != current[k]]
        if changed:
            raise ValueError(
                f"resume_from_checkpoint: the value pretraining in {self.folder} ran with other settings "
                f"({changed[0]}); resume with the same ones, or start over with overwrite_output_dir=True."
            )
        if "r2" not in progress:
            raise ValueError(
                f"resume_from_checkpoint: the value pretraining in {self.folder} was saved by a trl-sae that kept "
                "epochs by explained variance (no held-out R^2 recorded); start over with "
                "overwrite_output_dir=True."
            )
        progress["folder"] = str(folders[-1])
        return progress

    def _restore(self, progress: dict[str, Any]) -> dict[str, torch.Tensor]:
        folder = Path(progress.pop("folder"))
        _load_state(self.wrapper, load_file(str(folder / CRITIC_FILE)), str(folder))
        # On the CPU: load_state_dict moves each state to its parameter's device (a CPU DDP rank's device is
        # "cpu:0", a location torch.load cannot restore to).
        state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
        self.trainer.optimizer.load_state_dict(state)
        history = zip(progress["explained_variance"], progress["r2"], progress["loss"])
        for epoch, (ev, r2, loss) in enumerate(history):
            self._log(epoch, ev, r2, loss)  # the log history of the interrupted run, as it would read
        return load_file(str(folder / "best_critic.safetensors"))

    def _finish(self, progress: dict[str, Any], best: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Publish ``critic.safetensors`` then ``value_pretrain.json`` (the summary marks it finished)."""
        args = self.args
        history = progress["explained_variance"]
        summary = {
            "settings": self._settings(),
            "critic_identity": critic_identity(self.wrapper),
            "epochs_run": progress["epoch"],
            "best_epoch": progress["best_epoch"],
            "stopped_early": progress["epoch"] < args.value_pretrain_epochs,
            "explained_variance_held_out": history,
            "r2_held_out": progress["r2"],
            "loss": progress["loss"],
            "rollouts": {
                "fit": args.value_pretrain_rollouts,
                "held_out": args.value_pretrain_held_out,
                "processes": self.accelerator.num_processes,
            },
            "seconds": dict(self.seconds),
        }
        if self.accelerator.is_main_process:
            critic_file = self.folder / CRITIC_FILE
            _write_atomic(critic_file, lambda tmp: save_file(best, str(tmp)))
            summary["critic_sha256"] = _sha256(critic_file)
            _write_atomic(
                self.folder / SUMMARY_FILE, lambda tmp: tmp.write_text(json.dumps(summary, indent=2))
            )
            for folder in [*self.folder.glob(f"{PROGRESS_PREFIX}*"), self.folder / ROLLOUTS_DIR]:
                shutil.rmtree(folder, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return summary
