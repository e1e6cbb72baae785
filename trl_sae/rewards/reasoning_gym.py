"""Accuracy on reasoning-gym tasks, scored by each task's own verifier (``score_answer``).

The answer is the content of the completion's last ``<answer>...</answer>`` pair
(``reasoning_gym.utils.extract_answer``), the format :data:`trl_sae.gym.ANSWER_INSTRUCTION` asks for in
every prompt. A completion without one scores what the task gives a missing answer (0.0 for the
arithmetic tasks). Rows come from :func:`trl_sae.gym.load_reasoning_gym`, whose entry column carries the
task name, the data ``score_answer`` reads and the settings the row was generated with: the verifier is the
``score_answer`` of a generator built with those settings, since verifiers read them (reasoning-gym's own
``get_score_answer_fn`` builds the task's default settings, under which ``decimal_arithmetic`` with 5
decimal places accepts answers off by 5e-4).
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from trl_sae.gym import ENTRY_COLUMN, GENERATOR_KEY, generator_settings, gym_entry
from trl_sae.rewards.base import completion_text

__all__ = ["STRICTER_CHECKS", "extract_tagged_answer", "reasoning_gym_accuracy"]


def extract_tagged_answer(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` in ``text``; None if there is none."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(text, tag_name="answer", strip=True)


# One verifier per task and settings (a training and a held-out set: two per run).
_VERIFIERS: dict[tuple[str, str], Callable[[str | None, dict[str, Any]], float]] = {}


def _score_answer(entry: dict[str, Any]) -> Callable[[str | None, dict[str, Any]], float]:
    """The ``score_answer`` of a generator built with the settings that made ``entry``."""
    import reasoning_gym

    task, settings = entry["metadata"]["source_dataset"], generator_settings(entry)
    key = (task, repr(sorted(settings.items())))
    if key not in _VERIFIERS:
        _VERIFIERS[key] = reasoning_gym.create_dataset(task, **settings).score_answer
    return _VERIFIERS[key]


_ARITHMETIC = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _exact_value(node: ast.AST, numbers: list[int]) -> Fraction:
    """The exact value of an expression of non-negative integers under ``+ - * /`` (and parentheses),
    appending each integer it uses to ``numbers``; ValueError for anything else (or a division by zero)."""
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _exact_value(node.left, numbers), _exact_value(node.right, numbers)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _ARITHMETIC[type(node.op)](left, right)
    raise ValueError(f"not allowed in an answer: {ast.dump(node)}")


def _solves_puzzle24(answer: str, entry: dict[str, Any]) -> bool:
    """Whether ``answer`` makes exactly 24 from the puzzle's four numbers, each used once.

    reasoning-gym 0.1.25's verifier checks only that four numbers in range appear and that the value
    truncated to an int is 24: "6*4*1*1" scored 1.0 on every puzzle, and "6*4 + 1/2" (24.5) too.
    """
    try:
        used: list[int] = []
        value = _exact_value(ast.parse(answer.strip(), mode="eval").body, used)
    except (SyntaxError, ValueError, RecursionError):
        return False
    return value == 24 and Counter(used) == Counter(entry["metadata"]["numbers"])


# Checks a task's answers must pass on top of its own verifier, where that verifier can be gamed: an answer
# that fails one scores what the task gives a missing answer.
STRICTER_CHECKS: dict[str, Callable[[str, dict[str, Any]], bool]] = {"puzzle24": _solves_puzzle24}


def reasoning_gym_accuracy(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **columns: Any
) -> list[float]:
    """The task's ``score_answer`` (in [0, 1]) of each completion's ``<answer>`` content.

    Where a task's verifier can be gamed, the answer must also pass that task's entry in
    :data:`STRICTER_CHECKS` (``puzzle24``: exactly 24 from the puzzle's own numbers), else it scores as a
    missing answer.

    Args:
        prompts, completions, completion_ids: as every reward function gets them.
        columns: dataset columns; :data:`~trl_sae.gym.ENTRY_COLUMN` (one entry per completion) is required.

    Raises:
        ValueError: the dataset has no entry column, or its entries no generator settings (it was not built
            by ``load_reasoning_gym``).
    """
    entries = columns.get(ENTRY_COLUMN)
    if entries is None:
        raise ValueError(
            f"reasoning_gym_accuracy needs the {ENTRY_COLUMN!r} column: build the dataset with "
            "trl_sae.gym.load_reasoning_gym (or dataset_name: reasoning_gym:<task> in a recipe)."
        )
    scores = []
    for completion, value in zip(completions, entries, strict=True):
        entry = gym_entry(value)
        answer = extract_tagged_answer(completion_text(completion))
        task_entry = {k: v for k, v in entry.items() if k != GENERATOR_KEY}
        verifier = _score_answer(entry)
        check = STRICTER_CHECKS.get(task_entry["metadata"]["source_dataset"])
        if answer is not None and check is not None and not check(answer, task_entry):
            answer = None
        scores.append(float(verifier(answer, task_entry)))
    return scores
