"""The trainer's callbacks, as ``transformers.Trainer`` would have them: its defaults, the reporting
integrations ``report_to`` names, the user's, and a progress bar (or, with ``disable_tqdm``, printed logs)."""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import PrinterCallback

from trl_sae.trainer.config import SAEPPOConfig

__all__ = ["set_step_intervals", "trainer_callbacks"]


def trainer_callbacks(
    args: SAEPPOConfig, callbacks: list[TrainerCallback] | None
) -> list[TrainerCallback | type[TrainerCallback]]:
    """The callbacks (instances or classes, as ``CallbackHandler`` takes them) in ``Trainer``'s order."""
    default_callbacks = DEFAULT_CALLBACKS + get_reporting_integration_callbacks(args.report_to)
    chosen = default_callbacks if callbacks is None else default_callbacks + callbacks
    return [*chosen, PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK]


def set_step_intervals(state: Any, args: SAEPPOConfig) -> None:
    """The state's ``logging_steps``, ``eval_steps`` and ``save_steps`` the callbacks read: a value below 1 is a
    fraction of ``state.max_steps`` (rounded up), as in ``transformers.Trainer``."""
    for name in ("logging_steps", "eval_steps", "save_steps"):
        value = getattr(args, name)
        if value is not None:
            setattr(state, name, math.ceil(state.max_steps * value) if value < 1 else value)
