"""Loading and saving models, logging completions, checkpoints and resume."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OutputConfig", "parse_resume_flag"]


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


@dataclass
class OutputConfig:
    """Loading and saving models, logging completions, checkpoints and resume. Mixed into :class:`~trl_sae.SAEPPOConfig`, whose docstring documents each field."""

    model_init_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when `model` is a string."}
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: load the base in 4-bit NF4 (bitsandbytes) when `model` is a Hub id or path."
        },
    )
    merge_adapters: bool = field(
        default=False,
        metadata={"help": "Save / push a merged full model instead of the LoRA adapter only."},
    )
    log_completions: bool = field(
        default=False, metadata={"help": "Log sampled completions with boundaries."}
    )
    num_completions_to_print: int = field(default=4, metadata={"help": "Completions printed per log."})
    # Checkpoints and resume (trl_sae/checkpointing.py).
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Resume from this checkpoint folder, or 'true' for the newest intact one in output_dir "
            "(damaged ones are skipped with a warning); an explicit damaged folder is an error."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Let a fresh run delete the checkpoint-* folders already in output_dir (else an error), or "
            "a resume from an older checkpoint delete the ones saved after it."
        },
    )
