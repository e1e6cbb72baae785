"""STEM datasets of the SAE paper's STEM domain (train on SCP-116K, test on GPQA-Diamond), ready for the trainer.

Two layouts, each loaded from a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file or folder, or from a
Hugging Face Hub dataset (``datasets.load_dataset``):

* **multiple choice** (GPQA's layout): a question, the correct answer and incorrect answers in separate
  columns. :func:`load_multiple_choice_dataset` shuffles each row's options with a seed derived from the
  row's question (the same order on every machine and run), letters them ``A``, ``B``, ... in the prompt
  and returns the columns ``prompt``, ``answer`` (the gold letter) and ``choices`` (the option texts in
  letter order), which :func:`trl_sae.rewards.multiple_choice_accuracy` grades.
* **free-form science** (SCP-116K's layout): a problem and either a short ``answer`` or a worked
  ``solution`` whose last ``\\boxed{}`` is the answer. :func:`load_science_dataset` returns ``prompt`` and
  ``answer``, which :func:`trl_sae.rewards.science_accuracy` grades.

Recipes and ``trl-sae eval`` name them ``gpqa-diamond`` and ``scp-116k`` (:data:`STEM_DATASETS`), or
``multiple_choice:<path or Hub id>`` and ``science:<path or Hub id>`` for other datasets in these layouts
(:func:`parse_stem_name`). ``datasets`` is imported where it is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from trl_sae.data import DEFAULT_INSTRUCTION, format_prompt, load_rows

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = [
    "MULTIPLE_CHOICE_INSTRUCTION",
    "STEM_DATASETS",
    "StemDatasetSpec",
    "load_multiple_choice_dataset",
    "load_science_dataset",
    "load_stem_dataset",
    "parse_stem_name",
]

logger = logging.getLogger(__name__)

StemKind = Literal["multiple_choice", "science"]

#: Appended to every multiple-choice prompt: the boxed letter that multiple_choice_accuracy reads.
MULTIPLE_CHOICE_INSTRUCTION = (
    "Please reason step by step, and put the letter of the correct option within \\boxed{}."
)

GPQA_CORRECT = "Correct Answer"
GPQA_INCORRECT = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


@dataclass(frozen=True)
class StemDatasetSpec:
    """Where a STEM dataset lives and which layout it has.

    Attributes:
        kind: ``"multiple_choice"`` (GPQA's layout) or ``"science"`` (free-form answers).
        hub_id: the Hugging Face Hub dataset id.
        split: the split loaded by default.
        config_name: the Hub config (subset).
        description: one line for listings and error messages.
    """

    kind: StemKind
    hub_id: str
    split: str = "train"
    config_name: str | None = None
    description: str = ""


#: The paper's STEM datasets by short name (Appendix "Training Details": Qwen3-4B-Base, SCP-116K, GPQA-Diamond).
STEM_DATASETS: dict[str, StemDatasetSpec] = {
    "gpqa-diamond": StemDatasetSpec(
        kind="multiple_choice",
        hub_id="Idavidrein/gpqa",
        config_name="gpqa_diamond",
        description="GPQA-Diamond, 198 graduate-level questions with 4 options (gated: accept the terms on "
        "the Hub and log in first); columns Question, Correct Answer, Incorrect Answer 1-3",
    ),
    "scp-116k": StemDatasetSpec(
        kind="science",
        hub_id="EricLu/SCP-116K",
        description="SCP-116K, about 116k science problems with worked solutions (columns problem, "
        "matched_solution, ...); rows whose solution has no \\boxed{} final answer are dropped",
    ),
}

_PREFIXES: dict[str, StemKind] = {"multiple_choice:": "multiple_choice", "science:": "science"}


def parse_stem_name(name: str | None) -> tuple[StemKind, str] | None:
    """``(kind, source)`` for a STEM dataset name, or ``None`` for any other name.

    ``gpqa-diamond`` and ``scp-116k`` are :data:`STEM_DATASETS`; ``multiple_choice:<source>`` and
    ``science:<source>`` take a local path or a Hub id in that layout.

    Example:
        >>> parse_stem_name("gpqa-diamond"), parse_stem_name("science:./scp.jsonl"), parse_stem_name("amc")
        (('multiple_choice', 'gpqa-diamond'), ('science', './scp.jsonl'), None)
    """
    if not isinstance(name, str):
        return None
    text = name.strip()
    key = text.lower().replace("_", "-")
    if key in STEM_DATASETS:
        return STEM_DATASETS[key].kind, key
    for prefix, kind in _PREFIXES.items():
        if text.startswith(prefix):
            source = text[len(prefix) :].strip()
            if not source:
                raise ValueError(f"dataset {name!r}: name a local file or a Hub id after {prefix!r}.")
            return kind, source
    return None


def _load_rows(
    source: str | os.PathLike[str], split: str | None, kind: StemKind, cache_dir: str | None
) -> tuple[Dataset, str]:
    """The raw dataset of a :data:`STEM_DATASETS` name, a local path or a Hub id, and how to name it."""
    key = os.fspath(source).strip().lower().replace("_", "-")
    spec = STEM_DATASETS.get(key)
    if spec is not None and spec.kind != kind:
        raise ValueError(f"{os.fspath(source)!r} is a {spec.kind} dataset, not a {kind} one.")
    if spec is None:
        return load_rows(source, split, cache_dir=cache_dir, loader=f"load_{kind}_dataset")
    return load_rows(
        spec.hub_id,
        split or spec.split,
        config_name=spec.config_name,
        cache_dir=cache_dir,
        loader=f"load_{kind}_dataset",
    )


def _require_columns(dataset: Dataset, source: str, columns: dict[str, str]) -> None:
    """Every column (role -> name) exists; the message names the first missing one and the role's argument."""
    for role, column in columns.items():
        if column not in dataset.column_names:
            raise ValueError(
                f"{source} has no column {column!r} ({role}); its columns are {dataset.column_names}. Pass "
                f"{role}=... to map it."
            )


def _cell_text(row: dict[str, Any], column: str, index: int, source: str) -> str:
    """A required cell as stripped text; a missing or empty one is one line naming the row and column."""
    value = row.get(column)
    text = "" if value is None else str(value).strip()
    if not text:
        raise ValueError(f"{source}: row {index} has no value in column {column!r}; fill it or drop the row.")
    return text


def _row_seed(seed: int, question: str) -> int:
    # From the question's text, not the row's position: filtering or reordering rows keeps each order, and
    # sha256 (unlike hash()) is the same in every process.
    digest = hashlib.sha256(f"{seed}\0{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _check_size(dataset: Dataset, source: str, split: str | None) -> None:
    if len(dataset) == 0:
        raise ValueError(f"{source} is empty (split {split!r}); nothing to train or evaluate on.")


def load_multiple_choice_dataset(
    name: str | os.PathLike[str],
    split: str | None = None,
    chat: bool = True,
    instruction: str | None = MULTIPLE_CHOICE_INSTRUCTION,
    *,
    system_prompt: str | None = None,
    question_column: str = "Question",
    correct_column: str = GPQA_CORRECT,
    incorrect_columns: Sequence[str] = GPQA_INCORRECT,
    seed: int = 0,
    cache_dir: str | None = None,
) -> Dataset:
    """Load a GPQA-style dataset as lettered, shuffled options: columns ``prompt``, ``answer``, ``choices``.

    Each row's options (the correct answer and the incorrect ones) are shuffled with a seed derived from
    ``seed`` and the row's question, then listed after the question as ``A) ...``, ``B) ...``;
    ``answer`` is the letter of the correct one and ``choices`` the option texts in letter order.

    Args:
        name: ``"gpqa-diamond"``, a local file or folder, or a Hub dataset id (``owner/name``).
        split: the split; the dataset's default (``train``) when None.
        chat: ``prompt`` as chat messages (True) or plain text (False).
        instruction: appended after the options; None or ``""`` for none.
        system_prompt: a system message before the user turn (chat only).
        question_column, correct_column, incorrect_columns: the source columns (GPQA's by default).
        seed: changes every row's option order (the same ``seed`` gives the same order everywhere).
        cache_dir: passed to ``datasets.load_dataset``.

    Raises:
        ValueError: a missing column (named, with the argument that maps it), a row without a question
            or an option (its index and column named), or more than 10 options.
        DatasetUnavailableError: the Hub could not be reached.
    """
    from trl_sae.rewards.multiple_choice import LETTERS

    dataset, source = _load_rows(name, split, "multiple_choice", cache_dir)
    _check_size(dataset, source, split)
    incorrect = list(incorrect_columns)
    if not incorrect or len(incorrect) + 1 > len(LETTERS):
        raise ValueError(
            f"incorrect_columns: give 1 to {len(LETTERS) - 1} columns of incorrect options, got {incorrect}."
        )
    roles = {"question_column": question_column, "correct_column": correct_column}
    roles |= {f"incorrect_columns[{k}]": column for k, column in enumerate(incorrect)}
    _require_columns(dataset, source, roles)

    def to_example(row: dict[str, Any], index: int) -> dict[str, Any]:
        question = _cell_text(row, question_column, index, source)
        correct = _cell_text(row, correct_column, index, source)
        options = [correct, *(_cell_text(row, column, index, source) for column in incorrect)]
        order = list(range(len(options)))
        random.Random(_row_seed(seed, question)).shuffle(order)
        choices = [options[k] for k in order]
        listing = "\n".join(f"{LETTERS[k]}) {text}" for k, text in enumerate(choices))
        return {
            "_prompt": format_prompt(f"{question}\n\n{listing}", chat, instruction, system_prompt),
            "_answer": LETTERS[order.index(0)],
            "_choices": choices,
        }

    formatted = dataset.map(
        to_example, with_indices=True, remove_columns=dataset.column_names, desc="Formatting options"
    )
    return formatted.rename_columns({"_prompt": "prompt", "_answer": "answer", "_choices": "choices"})


_SOLUTION_COLUMNS = ("solution", "matched_solution")


def load_science_dataset(
    name: str | os.PathLike[str],
    split: str | None = None,
    chat: bool = True,
    instruction: str | None = DEFAULT_INSTRUCTION,
    *,
    system_prompt: str | None = None,
    problem_column: str = "problem",
    answer_column: str | None = None,
    solution_column: str | None = None,
    cache_dir: str | None = None,
) -> Dataset:
    """Load free-form science problems (SCP-116K's layout) as ``prompt`` + ``answer`` columns.

    The gold answer is ``answer_column`` as written, or else the last ``\\boxed{}`` of ``solution_column``
    (a worked solution). By default the dataset's ``answer`` column is used if it has one, else its
    ``solution`` or ``matched_solution`` column (SCP-116K's). Rows whose solution has no ``\\boxed{}``
    answer cannot be graded and are dropped, with a warning that counts them.

    Args:
        name: ``"scp-116k"``, a local file or folder, or a Hub dataset id (``owner/name``).
        split: the split; the dataset's default (``train``) when None.
        chat, instruction, system_prompt: as for :func:`trl_sae.data.load_math_dataset`.
        problem_column: the column with the problem.
        answer_column: the column with short gold answers.
        solution_column: the column with worked solutions (used when there is no answer column).
        cache_dir: passed to ``datasets.load_dataset``.

    Raises:
        ValueError: a missing column (named), a row without a problem or answer (its index and column
            named), both ``answer_column`` and ``solution_column``, or no row with a gradable answer.
        DatasetUnavailableError: the Hub could not be reached.
    """
    from trl_sae.rewards.format import boxed_answers

    if answer_column is not None and solution_column is not None:
        raise ValueError("pass answer_column or solution_column, not both: the gold answer comes from one.")
    dataset, source = _load_rows(name, split, "science", cache_dir)
    _check_size(dataset, source, split)
    if answer_column is None and solution_column is None:
        if "answer" in dataset.column_names:
            answer_column = "answer"
        else:
            solution_column = next((c for c in _SOLUTION_COLUMNS if c in dataset.column_names), None)
            if solution_column is None:
                raise ValueError(
                    f"{source} has columns {dataset.column_names}: no 'answer' column and no solution column "
                    f"({', '.join(_SOLUTION_COLUMNS)}); pass answer_column= or solution_column= to map one."
                )
    gold_role, gold_column = (
        ("answer_column", answer_column)
        if answer_column is not None
        else ("solution_column", solution_column)
    )
    assert gold_column is not None
    _require_columns(dataset, source, {"problem_column": problem_column, gold_role: gold_column})

    def to_example(row: dict[str, Any], index: int) -> dict[str, Any]:
        problem = _cell_text(row, problem_column, index, source)
        gold = _cell_text(row, gold_column, index, source)
        if solution_column is not None:
            boxed = [b.strip() for b in boxed_answers(gold) if b is not None and b.strip()]
            gold = boxed[-1] if boxed else ""
        return {"_prompt": format_prompt(problem, chat, instruction, system_prompt), "_answer": gold}

    formatted = dataset.map(
        to_example, with_indices=True, remove_columns=dataset.column_names, desc="Formatting problems"
    )
    if solution_column is not None:
        kept = formatted.filter(lambda row: bool(row["_answer"]), desc="Dropping ungradable rows")
        dropped = len(formatted) - len(kept)
        if not len(kept):
            raise ValueError(
                f"{source}: no solution in column {solution_column!r} ends in a \\boxed{{}} answer, so no "
                "row can be graded; pass answer_column= with short gold answers."
            )
        if dropped:
            logger.warning(
                "%s: dropped %d of %d rows whose %r has no \\boxed{} final answer (they cannot be graded).",
                source,
                dropped,
                len(formatted),
                solution_column,
            )
        formatted = kept
    return formatted.rename_columns({"_prompt": "prompt", "_answer": "answer"})


def load_stem_dataset(
    name: str,
    split: str | None = None,
    chat: bool = True,
    *,
    system_prompt: str | None = None,
    cache_dir: str | None = None,
) -> tuple[Dataset, str]:
    """A STEM dataset by name (see :func:`parse_stem_name`) and the reward that grades it:
    ``multiple_choice_accuracy`` or ``science_accuracy``.

    Raises:
        ValueError: ``name`` is not a STEM dataset name.
    """
    parsed = parse_stem_name(name)
    if parsed is None:
        raise ValueError(
            f"{name!r} is not a STEM dataset: use {sorted(STEM_DATASETS)}, multiple_choice:<source> or "
            "science:<source>."
        )
    kind, source = parsed
    if kind == "multiple_choice":
        dataset = load_multiple_choice_dataset(
            source, split, chat, system_prompt=system_prompt, cache_dir=cache_dir
        )
        return dataset, "multiple_choice_accuracy"
    dataset = load_science_dataset(source, split, chat, system_prompt=system_prompt, cache_dir=cache_dir)
    return dataset, "science_accuracy"
