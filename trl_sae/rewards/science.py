"""Free-form science answers (numbers with units, expressions) and the STEM reward that also grades options.

:func:`science_accuracy` grades a completion's final answer against a free-form gold answer such as
``3.2 m s^-1``, ``6.6 \\times 10^{-34} J s`` or ``\\frac{\\hbar^2}{2m}``:

1. The final answer is the content of the completion's last ``\\boxed{...}`` after any reasoning (after the
   last ``</think>``), else the rest of the sentence after its last "answer is" / "answer:"; without either
   the completion scores 0.0.
2. Gold and answer are split into a value and a unit (:func:`trl_sae.rewards.units.split_quantity`; the
   supported numbers and units are listed in :mod:`trl_sae.rewards.units`). Then:

   * gold without a unit: the answer's unit, if any, is dropped (the question fixed the unit);
   * gold with a unit, answer without one: the answer's number is read in the gold's unit;
   * both with units written alike: the values are compared;
   * both with units of the same dimension: the answer's value is converted to the gold's unit
     (``320 cm`` equals ``3.2 m``; this needs a plain number, a symbolic value in another unit scores 0.0);
   * units of different dimensions (``3.2 m`` for ``3.2 m/s``), or ``°C`` against any other unit: 0.0.

   Text after the value that is not a supported unit is not split off: it stays part of the value, which
   math-verify then compares as written (``3 apples`` equals only ``3 apples``).
3. Values that are both plain numbers are equal within a relative tolerance (``rel_tol``, 1% by default):
   math-verify rounds floats to 6 decimals, which would make ``6.63e-34`` equal ``1e-34``. Any other
   value (``\\frac{16}{5}``, ``2\\sqrt{3}``, ``x^2+1``) goes to math-verify through
   :func:`~trl_sae.rewards.math.make_math_accuracy`'s worker pool and per-item timeout.

:func:`stem_accuracy` grades each row by its kind: :func:`~trl_sae.rewards.multiple_choice.multiple_choice_accuracy`
where the row has options (a ``choices`` column, as GPQA-style datasets have), :func:`science_accuracy`
otherwise; a STEM run trains on free-form SCP-116K and evaluates on multiple-choice GPQA with one reward.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from trl_sae.rewards.base import RewardFunction, graded_rows, required_column
from trl_sae.rewards.format import boxed_answers, final_part
from trl_sae.rewards.math import Backend, gold_text, make_math_accuracy
from trl_sae.rewards.multiple_choice import make_multiple_choice_accuracy
from trl_sae.rewards.units import Quantity, conversion_factor, same_unit_text, split_quantity

__all__ = ["final_answer", "make_science_accuracy", "make_stem_accuracy", "science_accuracy", "stem_accuracy"]

_CUE_RE = re.compile(r"\banswer\s*(?:is|:|=)\s*:?", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\n|[.!?;](?=\s|$)")


def final_answer(text: str) -> str | None:
    """The final answer's text: the last ``\\boxed{}`` after any reasoning, else the sentence after the last
    "answer is" / "answer:"; ``None`` if there is neither.

    Example:
        >>> final_answer(r"v = d/t, so \\boxed{3.2\\ \\mathrm{m/s}}."), final_answer("The answer is 4 K. Done")
        ('3.2\\\\ \\\\mathrm{m/s}', '4 K')
    """
    final = final_part(text)
    if final is None:
        return None
    boxed = [b for b in boxed_answers(final) if b is not None and b.strip()]
    if boxed:
        return boxed[-1].strip()
    cues = list(_CUE_RE.finditer(final.replace("*", "")))
    if not cues:
        return None
    rest = final.replace("*", "")[cues[-1].end() :]
    end = _SENTENCE_END_RE.search(rest)
    answer = rest[: end.start() if end else len(rest)].strip()
    return answer or None


_MATCH, _MISMATCH = 1.0, 0.0
# split_quantity's plain text back to LaTeX math-verify reads
_TO_LATEX = str.maketrans({"×": r" \times ", "·": r" \cdot ", "µ": r"\mu ", "Ω": r"\Omega ", "°": r"^\circ "})


def _latex(expression: str) -> str:
    return expression.translate(_TO_LATEX)


class _ScienceAccuracy:
    """The callable behind :func:`science_accuracy` and :func:`make_science_accuracy`."""

    def __init__(
        self,
        *,
        rel_tol: float,
        answer_column: str,
        name: str,
        timeout_seconds: float | None,
        backend: Backend,
        num_workers: int | None,
    ) -> None:
        if not (isinstance(rel_tol, numbers.Real) and 0 <= rel_tol < 1 and math.isfinite(rel_tol)):
            raise ValueError(f"`rel_tol` must be a number in [0, 1), got {rel_tol!r}.")
        self.rel_tol, self.answer_column, self.__name__ = float(rel_tol), answer_column, name
        # Symbolic values go to math-verify, with its worker pool and timeouts.
        self._math = make_math_accuracy(
            timeout_seconds=timeout_seconds,
            backend=backend,
            num_workers=num_workers,
            answer_column="answer",
            name=name,
        )

    def __repr__(self) -> str:
        return (
            f"make_science_accuracy(rel_tol={self.rel_tol}, answer_column={self.answer_column!r}, "
            f"name={self.__name__!r}, math={self._math!r})"
        )

    def _numbers_equal(self, gold: float, value: float) -> bool:
        return math.isclose(value, gold, rel_tol=self.rel_tol, abs_tol=0.0 if gold else 1e-12)

    def decide(self, gold: Quantity, answer: Quantity) -> float | tuple[str, str]:
        """A score, or the ``(gold value, answer value)`` texts that math-verify must compare."""
        answer_number, answer_expression = answer.number, answer.expression
        if gold.unit_text and answer.unit_text and not same_unit_text(gold.unit_text, answer.unit_text):
            # split_quantity only splits off units it can read, so both are set here
            assert gold.unit is not None and answer.unit is not None
            factor = conversion_factor(answer.unit, gold.unit)
            if factor is None:
                return _MISMATCH  # another dimension (or a temperature scale against another unit)
            if factor != 1.0:
                if answer_number is None:
                    return _MISMATCH  # converting a symbolic value is not supported
                answer_number *= factor
                answer_expression = repr(answer_number)
        if gold.number is not None and answer_number is not None:
            return _MATCH if self._numbers_equal(gold.number, answer_number) else _MISMATCH
        return _latex(gold.expression), _latex(answer_expression)

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        golds = required_column(
            columns,
            self.answer_column,
            reward=self.__name__,
            holds="the gold answers",
            fix="Use make_science_accuracy(answer_column=...).",
            num_completions=len(completions),
        )
        scores: list[float | None] = [None] * len(completions)
        symbolic: list[tuple[int, str, str]] = []
        for i, text, gold_answer in graded_rows(completions, golds, lambda value, _: gold_text(value)):
            answer = final_answer(text)
            if answer is None:
                scores[i] = 0.0
                continue
            gold_quantity, answer_quantity = split_quantity(gold_answer), split_quantity(answer)
            decided = self.decide(gold_quantity, answer_quantity)
            if isinstance(decided, tuple) and not (gold_quantity.unit_text or answer_quantity.unit_text):
                symbolic.append(
                    (i, gold_answer, answer)
                )  # no unit anywhere: math-verify reads them as written
            elif isinstance(decided, tuple):
                symbolic.append((i, *decided))
            else:
                scores[i] = decided
        if symbolic:
            verified = self._math(
                [None] * len(symbolic),
                [f"\\boxed{{{answer}}}" for _, _, answer in symbolic],
                None,
                answer=[gold for _, gold, _ in symbolic],
            )
            for (i, _, _), score in zip(symbolic, verified):
                scores[i] = score
        return scores


def make_science_accuracy(
    *,
    rel_tol: float = 0.01,
    answer_column: str = "answer",
    name: str = "science_accuracy",
    timeout_seconds: float | None = 5.0,
    backend: Backend = "auto",
    num_workers: int | None = None,
) -> RewardFunction:
    """A :func:`science_accuracy` with its own settings.

    Args:
        rel_tol: relative tolerance between two plain numbers (after unit conversion); 0 for exact.
        answer_column: the column with the gold answers.
        name: the function's ``__name__`` (its metrics name).
        timeout_seconds, backend, num_workers: math-verify's, for symbolic values (see
            :func:`~trl_sae.rewards.math.make_math_accuracy`).

    Example:
        >>> exact = make_science_accuracy(rel_tol=0.0, timeout_seconds=None)
        >>> exact(None, [r"\\boxed{3.21 m/s}", r"\\boxed{320 cm/s}"], None, answer=["3.2 m/s", "3.2 m/s"])
        [0.0, 1.0]
    """
    return _ScienceAccuracy(
        rel_tol=rel_tol,
        answer_column=answer_column,
        name=name,
        timeout_seconds=timeout_seconds,
        backend=backend,
        num_workers=num_workers,
    )


_DEFAULT_SCIENCE = make_science_accuracy()


def science_accuracy(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 if a completion's final answer equals the free-form gold ``answer`` (units handled), else 0.0.

    The rules are in this module's documentation: the last ``\\boxed{}``; a unit matching the gold's is
    dropped, one of the same dimension converted, one of another dimension scores 0.0; plain numbers equal
    within 1%; anything else compared by math-verify. A row without a gold answer scores ``None``.

    Example:
        >>> science_accuracy(None, [r"\\boxed{3.2 m/s}", r"\\boxed{3.2}", r"\\boxed{3.2 m}"], None,
        ...                  answer=["3.2 m s^-1", "3.2 m s^-1", "3.2 m s^-1"])
        [1.0, 1.0, 0.0]
    """
    return _DEFAULT_SCIENCE(prompts, completions, completion_ids, **columns)


class _StemAccuracy:
    """The callable behind :func:`stem_accuracy`: each row graded by its kind."""

    def __init__(self, choices_column: str, science: RewardFunction, choice: RewardFunction, name: str):
        self.choices_column, self.science, self.choice, self.__name__ = choices_column, science, choice, name

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        options = columns.get(self.choices_column)
        kinds = [bool(options is not None and options[i]) for i in range(len(completions))]
        scores: list[float | None] = [None] * len(completions)
        for is_choice, grader in ((True, self.choice), (False, self.science)):
            rows = [i for i, kind in enumerate(kinds) if kind is is_choice]
            if not rows:
                continue
            part = {key: [values[i] for i in rows] for key, values in columns.items()}
            graded = grader(
                [prompts[i] for i in rows] if prompts is not None else None,
                [completions[i] for i in rows],
                [completion_ids[i] for i in rows] if completion_ids is not None else None,
                **part,
            )
            for i, score in zip(rows, graded, strict=True):
                scores[i] = score
        return scores


def make_stem_accuracy(
    *, choices_column: str = "choices", rel_tol: float = 0.01, name: str = "stem_accuracy"
) -> RewardFunction:
    """A :func:`stem_accuracy` with another options column or tolerance (``answer`` holds every gold)."""
    return _StemAccuracy(
        choices_column,
        make_science_accuracy(rel_tol=rel_tol, name=name),
        make_multiple_choice_accuracy(choices_column=choices_column, name=name),
        name,
    )


_DEFAULT_STEM = make_stem_accuracy()


def stem_accuracy(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **columns: Any
) -> list[float | None]:
    """:func:`~trl_sae.rewards.multiple_choice.multiple_choice_accuracy` for rows with options (a non-empty
    ``choices`` column), :func:`science_accuracy` for the others: one reward for a run that trains on
    free-form problems and evaluates on multiple-choice ones (the paper's SCP-116K -> GPQA-Diamond).

    Example:
        >>> stem_accuracy(None, [r"\\boxed{B}", r"\\boxed{4 K}"], None,
        ...               answer=["B", "4 K"], choices=[["x", "y"], None])
        [1.0, 1.0]
    """
    return _DEFAULT_STEM(prompts, completions, completion_ids, **columns)
