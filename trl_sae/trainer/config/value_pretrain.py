"""The value-pretraining settings of :class:`~trl_sae.SAEPPOConfig` (VC-PPO), a dataclass mixin.

What the trainer does with them is :mod:`trl_sae.trainer.parts.value_pretrain`; what needs the built trainer (the
rollout batch size over every process, the dataset, the critic a saved one must match) is checked there,
when the trainer is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ValuePretrainConfig"]


@dataclass
class ValuePretrainConfig:
    r"""Value pretraining (VC-PPO): fit the critic alone on the initial policy's rollouts before PPO.

    Parameters:
        value_pretrain_rollouts (`int`, defaults to `0`):
            Completions sampled from the initial policy to fit the critic on before the first PPO update, over
            every process; `0`: no value pretraining. A multiple of the rollout batch (`batch_size`: completions
            per PPO step over every process). They come from a prompt order of their own, so the PPO steps
            afterwards draw exactly the prompts (and samples) a run without pretraining draws.
        value_pretrain_held_out (`int`, defaults to `0`):
            Completions sampled from other prompts (never fitted on) on which the critic is scored after each
            epoch, over every completion token: R^2 (`1 - E[(R - V)^2] / Var(R)`, which an offset of every
            value lowers) decides early stopping and which epoch's critic is kept; explained variance (as
            `critic/explained_variance`, blind to such an offset) is logged beside it. Required (a multiple of
            `batch_size`) with `value_pretrain_rollouts`.
        value_pretrain_epochs (`int`, defaults to `10`):
            Most passes over the fitting rollouts, each in the PPO update's mini- and micro-batches.
        value_pretrain_patience (`int`, *optional*, defaults to `3`):
            Stop after this many epochs without the held-out R^2 rising by more than
            `value_pretrain_min_delta` over the best so far; the best epoch's critic is kept either way (the
            initial critic counts as epoch 0). `None`: run every epoch.
        value_pretrain_min_delta (`float`, defaults to `0.0`):
            The rise of held-out R^2 that counts as an improvement.
        value_pretrain_learning_rate (`float`, *optional*):
            The critic's learning rate while pretraining (constant, no warm-up); `None`: `critic_learning_rate`.
            Pretraining has its own AdamW state: PPO's optimizer starts on the pretrained critic as it would on
            one loaded with `value_pretrain_path`.
        value_pretrain_path (`str`, *optional*):
            A `value_pretrain/` folder written by an earlier run (`<output_dir>/value_pretrain`): its critic is
            loaded and no pretraining runs, so several runs can start from one pretrained critic. Refused when its
            critic (kind, model, LoRA, `value_head_layer`) differs from this run's. Not with
            `value_pretrain_rollouts`.
    """

    value_pretrain_rollouts: int = field(
        default=0,
        metadata={
            "help": "Value pretraining (VC-PPO): completions of the initial policy to fit the critic on."
        },
    )
    value_pretrain_held_out: int = field(
        default=0,
        metadata={
            "help": "Value pretraining: completions of other prompts, to score the critic on (held-out R^2)."
        },
    )
    value_pretrain_epochs: int = field(
        default=10, metadata={"help": "Value pretraining: most passes over the fitting rollouts."}
    )
    value_pretrain_patience: int | None = field(
        default=3,
        metadata={
            "help": "Value pretraining: epochs without held-out improvement before stopping; None: never."
        },
    )
    value_pretrain_min_delta: float = field(
        default=0.0,
        metadata={"help": "Value pretraining: the held-out R^2 rise that counts as improving."},
    )
    value_pretrain_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Value pretraining: the critic's learning rate; None: critic_learning_rate."},
    )
    value_pretrain_path: str | None = field(
        default=None,
        metadata={
            "help": "A value_pretrain/ folder of an earlier run: load its critic instead of pretraining."
        },
    )

    @property
    def value_pretraining(self) -> bool:
        """Whether this run pretrains its critic (``value_pretrain_rollouts > 0``)."""
        return self.value_pretrain_rollouts > 0

    def _validate_value_pretrain(self, fail: Any) -> None:
        """Ranges, then what the other value_pretrain_* fields need (``fail(name, problem)`` raises)."""
        counts = {
            "value_pretrain_rollouts": (0, "completions to pretrain the critic on; 0 for off"),
            "value_pretrain_held_out": (0, "held-out completions"),
            "value_pretrain_epochs": (1, "passes over the fitting rollouts"),
        }
        for name, (low, meaning) in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                fail(name, f"must be an int >= {low} ({meaning}), got {value!r}.")
        patience = self.value_pretrain_patience
        if patience is not None and (
            isinstance(patience, bool) or not isinstance(patience, int) or patience < 1
        ):
            fail(
                "value_pretrain_patience",
                f"must be an int >= 1 or None (never stop early), got {patience!r}.",
            )
        if not self.value_pretrain_min_delta >= 0:
            fail("value_pretrain_min_delta", f"must be >= 0, got {self.value_pretrain_min_delta!r}.")
        lr = self.value_pretrain_learning_rate
        if lr is not None and not lr > 0:
            fail(
                "value_pretrain_learning_rate",
                f"must be > 0 (a critic that learns) or None (critic_learning_rate), got {lr!r}.",
            )
        path = self.value_pretrain_path
        pretraining = self.value_pretrain_rollouts > 0
        if (pretraining or path is not None) and not self.uses_critic:
            name = "value_pretrain_rollouts" if pretraining else "value_pretrain_path"
            fail(
                name,
                f"advantage_estimator={self.advantage_estimator!r} trains no critic, so there is none to "
                "pretrain or load; drop it or pick an estimator with a critic (sae, gae, mc, adaptive_lambda).",
            )
        if path is not None:
            if pretraining:
                fail(
                    "value_pretrain_path",
                    "loads a pretrained critic instead of pretraining one; set value_pretrain_rollouts=0 or drop "
                    "value_pretrain_path.",
                )
            if not os.path.isdir(path):
                fail(
                    "value_pretrain_path", f"{path!r} is not a folder; pass an earlier run's value_pretrain/."
                )
        defaults = {f.name: f.default for f in ValuePretrainConfig.__dataclass_fields__.values()}
        if not pretraining:
            for name in (
                "value_pretrain_held_out",
                "value_pretrain_epochs",
                "value_pretrain_patience",
                "value_pretrain_min_delta",
                "value_pretrain_learning_rate",
            ):
                if getattr(self, name) != defaults[name]:
                    why = "value_pretrain_rollouts=0, so no pretraining runs; set both or drop it."
                    if path is not None:  # a recipe that pretrains, pointed at a finished pretraining
                        why = "value_pretrain_path loads a finished critic instead of pretraining; drop it."
                    fail(name, f"is set but {why}")
            return
        if self.value_pretrain_held_out == 0:
            fail(
                "value_pretrain_held_out",
                "must be >= 1 with value_pretrain_rollouts: the held-out R^2 decides when "
                "pretraining stops and which epoch's critic is kept (a multiple of the rollout batch, e.g. "
                f"{self.per_device_train_batch_size * self.gradient_accumulation_steps}).",
            )
        local = self.per_device_train_batch_size * self.gradient_accumulation_steps
        for name in ("value_pretrain_rollouts", "value_pretrain_held_out"):
            if getattr(self, name) % local:
                fail(
                    name,
                    f"{getattr(self, name)} is not a multiple of the completions one rollout batch gives on a "
                    f"process (per_device_train_batch_size x gradient_accumulation_steps = {local}; times the "
                    "number of processes over all of them).",
                )
