"""Helpers shared by the ``trl-sae`` commands: the user-facing error, model and prompt loading, JSON and
table output, argument types and the options several commands take."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "MODEL_HELP",
    "PROG",
    "CLIError",
    "HelpFormatter",
    "add_common_arguments",
    "add_prompt_source",
    "first_line",
    "load_causal_lm",
    "load_prompts",
    "open_unit_floats",
    "positive_int",
    "print_table",
    "probability",
    "resolve_device",
    "set_threads",
    "unit_floats",
    "write_json",
]

PROG = "trl-sae"
# What every --model takes (load_causal_lm): resolve_pretrained turns a *.gguf file into its folder + gguf_file.
MODEL_HELP = "A Hub id, a local folder (full model or LoRA adapter) or a *.gguf file."


class CLIError(Exception):
    """A user-facing error: printed as one line, with an optional hint, and exit status 1."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------
def first_line(text: str, limit: int = 400) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def set_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    elif not torch.cuda.is_available() and (os.cpu_count() or 1) <= 4:
        # Small models on a few CPU cores are dispatch-bound: one thread avoids OpenMP spin contention.
        torch.set_num_threads(1)


def resolve_device(requested: str | None) -> str:
    import torch

    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_causal_lm(
    path: str, device: str | None = None, dtype: str | None = None, progress: bool = True
) -> tuple[Any, Any]:
    """A causal LM (a full model or a LoRA adapter folder) and its tokenizer, for the analysis commands."""
    from trl_sae.gguf import (
        from_pretrained_dense,
        load_adapter_model,
        resolve_pretrained,
        tokenizer_from_pretrained,
    )

    # A *.gguf file becomes its folder + gguf_file; messages name the path as given, the file.
    source, kwargs = resolve_pretrained(path, "--model")
    import transformers
    from transformers import AutoModelForCausalLM

    if not progress:
        transformers.utils.logging.disable_progress_bar()

    if dtype:
        kwargs["dtype"] = dtype
    try:
        tokenizer = tokenizer_from_pretrained(source, kwargs, padding_side="left")
        if os.path.isfile(os.path.join(os.path.expanduser(source), "adapter_config.json")):
            model = load_adapter_model(AutoModelForCausalLM, source, **kwargs)
        else:
            model = from_pretrained_dense(AutoModelForCausalLM, source, **kwargs)
    except (OSError, ValueError) as error:
        raise CLIError(f"cannot load model {path!r}: {first_line(str(error))}") from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(resolve_device(device)).eval(), tokenizer


def load_prompts(
    dataset: str | None, task: str | None, split: str | None, limit: int | None, seed: int
) -> tuple[Any, Any]:
    """``(dataset, reward_func)`` for the analysis commands: a math dataset (math-verify) or a synthetic task."""
    if task:
        from trl_sae.demo.tasks import make_running_sum_dataset, running_sum_reward

        variant = "long" if task == "running-sum-long" else "default"
        rows = make_running_sum_dataset(limit or 64, seed=seed + 1, variant=variant)
        return rows, running_sum_reward
    if not dataset:
        raise CLIError("pass --dataset (a math dataset name or file) or --task running-sum.")
    from trl_sae.data import DatasetUnavailableError, load_math_dataset
    from trl_sae.rewards.math import math_accuracy

    try:
        rows = load_math_dataset(dataset, split=split)
    except DatasetUnavailableError as error:
        raise CLIError(
            first_line(str(error)),
            hint="offline? download it elsewhere (`hf download <id> --repo-type dataset --local-dir DIR`) and "
            "pass --dataset DIR.",
        ) from error
    except FileNotFoundError as error:
        raise CLIError(f"dataset {dataset!r}: {first_line(str(error))}") from error
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    return rows, math_accuracy


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A rich table on a terminal, a plain aligned one otherwise (logs, pipes)."""
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in cells:
            table.add_row(*row)
        Console().print(table)
    except ImportError:  # pragma: no cover - rich is a dependency
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for row in cells:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


# --------------------------------------------------------------------------------------------------
# Argument types and options shared by several commands
# --------------------------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type of every count option (steps, samples, tokens, batch size, limit, threads): an int >= 1.

    ``int`` alone lets 0 or a negative through, where it means something else downstream (``--steps 0``
    made the demo train for every epoch, since ``max_steps <= 0`` means "use the epochs").
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def probability(text: str) -> float:
    """argparse type of a probability threshold such as SAE's ``p``: a number strictly between 0 and 1.

    Checked while parsing, so ``trl-sae demo -p 2`` (or ``nan``, ``0``) fails before the warm start rather
    than after it.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(",", " ").split()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from error


def open_unit_floats(text: str) -> list[float]:
    """``--p-grid``: SAE thresholds, each a probability strictly between 0 and 1."""
    values = _floats(text)
    outside = [value for value in values if not 0.0 < value < 1.0]
    if not values or outside:
        raise argparse.ArgumentTypeError(
            f"expected thresholds strictly between 0 and 1 (e.g. 0.1,0.2,0.5), got {text!r}"
        )
    return values


def unit_floats(text: str) -> list[float]:
    """``--lam-grid``: GAE lambdas, each in [0, 1]."""
    values = _floats(text)
    if not values or any(not 0.0 <= value <= 1.0 for value in values):
        raise argparse.ArgumentTypeError(f"expected lambdas in [0, 1] (e.g. 0,0.95,1), got {text!r}")
    return values


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown in the option list, descriptions and examples kept as written."""


def add_common_arguments(parser: argparse.ArgumentParser, device: bool = True) -> None:
    if device:
        parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (cuda when available).")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (1 on small CPU machines by default).",
    )
    parser.add_argument("--no-progress", action="store_true", help="No progress bars.")


def add_prompt_source(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--dataset",
        default=None,
        help="Prompts: a math dataset name (aime-2024, ...) or a local file / folder.",
    )
    source.add_argument(
        "--task",
        choices=["running-sum", "running-sum-long"],
        default=None,
        help="The offline synthetic task instead (the demo's running sums).",
    )
    parser.add_argument("--split", default=None, help="Dataset split.")
    parser.add_argument("--limit", type=positive_int, default=None, help="Use at most this many prompts.")
    parser.add_argument("--seed", type=int, default=0, help="Sampling seed.")
