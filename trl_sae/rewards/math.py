"""Math accuracy: a completion's final answer graded against the gold answer by Hugging Face's math-verify.

:func:`math_accuracy` grades final answers with ``math-verify`` (never a home-made parser) under a
per-item timeout that also works outside the main thread; the timeout machinery (a SIGALRM timer or a pool
of worker processes) is in :mod:`trl_sae.rewards._verify_worker`. math-verify is imported where it is used.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

from trl_sae.rewards._verify_worker import (
    DIED,
    TIMEOUT,
    cached_scorer,
    default_num_workers,
    first_pass_seconds,
    process_pool,
    score_with_alarm,
    signal_backend_available,
)
from trl_sae.rewards.base import RewardFunction, graded_rows, required_column

__all__ = ["gold_text", "make_math_accuracy", "math_accuracy"]

logger = logging.getLogger(__name__)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def gold_text(value: Any) -> str | None:
    """The gold answer as text; ``None`` when there is none."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        # AMC's answers are stored as floats: 142.0 should read "142", not "142.0".
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    return text or None


Backend = Literal["auto", "signal", "process"]


# score(items, per-item timeout, deadline or None) -> one result or sentinel per item
_BatchScorer = Callable[[Sequence[tuple[str, str]], float, float | None], list[float | object | None]]


def _score_in_two_passes(
    score: _BatchScorer, items: Sequence[tuple[str, str]], timeout_seconds: float
) -> list[float | object | None]:
    """Score a batch so that its overrunning items cost about one ``timeout_seconds`` together.

    A training step waits for the whole batch, and a pool of N workers spending the full cap on each of P
    pathological items costs ``ceil(P / N)`` caps. So every item is first tried with a short budget
    (:func:`~trl_sae.rewards._verify_worker.first_pass_seconds`, a tenth of the cap): ordinary answers,
    milliseconds each, are all scored then, never queued behind a pathological one. The items that
    overran are retried with the full cap under one deadline, one cap from the retry's start: an item
    still running then, or not started by then, scores 0 (the timeout warning). A batch thus costs its
    normal work, ``ceil(P / N)`` first-pass budgets and at most one cap (plus the kill grace of a worker
    stuck inside C code, which is replaced).
    """
    first_pass = first_pass_seconds(timeout_seconds)
    results = score(items, first_pass, None)
    retry = [k for k, result in enumerate(results) if result is TIMEOUT]
    if retry and first_pass < timeout_seconds:
        deadline = time.monotonic() + timeout_seconds
        retried = score([items[k] for k in retry], timeout_seconds, deadline)
        for k, result in zip(retry, retried):
            results[k] = result
    return results


class _MathAccuracy:
    """The callable behind :func:`math_accuracy` and :func:`make_math_accuracy` (picklable)."""

    def __init__(
        self,
        *,
        timeout_seconds: float | None,
        backend: Backend,
        answer_column: str,
        float_rounding: int,
        numeric_precision: int,
        strict: bool,
        name: str,
        num_workers: int | None = None,
    ) -> None:
        if timeout_seconds is not None and not (
            isinstance(timeout_seconds, numbers.Real) and timeout_seconds > 0
        ):
            raise ValueError(f"`timeout_seconds` must be a positive number or None, got {timeout_seconds!r}.")
        if backend not in ("auto", "signal", "process"):
            raise ValueError(f"`backend` must be 'auto', 'signal' or 'process', got {backend!r}.")
        if num_workers is not None and not (
            isinstance(num_workers, numbers.Integral)
            and not isinstance(num_workers, bool)
            and num_workers >= 1
        ):
            raise ValueError(f"`num_workers` must be a positive integer or None, got {num_workers!r}.")
        self.timeout_seconds = None if timeout_seconds is None else float(timeout_seconds)
        self.backend = backend
        self.num_workers = None if num_workers is None else int(num_workers)
        self.answer_column = answer_column
        self.scorer_config = {
            "float_rounding": int(float_rounding),
            "numeric_precision": int(numeric_precision),
            "strict": bool(strict),
        }
        self.__name__ = name

    def __repr__(self) -> str:
        return (
            f"make_math_accuracy(timeout_seconds={self.timeout_seconds}, backend={self.backend!r}, "
            f"num_workers={self.num_workers}, answer_column={self.answer_column!r}, name={self.__name__!r})"
        )

    def _num_workers(self) -> int:
        return self.num_workers if self.num_workers is not None else default_num_workers()

    def _resolve_backend(self) -> str:
        if self.timeout_seconds is None:
            return "inline"
        if self.backend == "signal" and not signal_backend_available():
            raise RuntimeError(
                "math_accuracy backend='signal' needs the main thread on a POSIX system; use "
                "backend='process' (or 'auto') from other threads."
            )
        if self.backend == "auto":
            # Several workers verify a batch in parallel; with one, the in-process timer is cheaper.
            return "signal" if self._num_workers() == 1 and signal_backend_available() else "process"
        return self.backend

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        name = self.__name__
        golds = required_column(
            columns,
            self.answer_column,
            reward=name,
            holds="the gold answers",
            fix="Rename the column or use make_math_accuracy(answer_column=...).",
            num_completions=len(completions),
        )
        todo = [
            (i, gold, text)
            for i, text, gold in graded_rows(completions, golds, lambda value, _: gold_text(value))
        ]
        scores: list[float | None] = [None] * len(completions)
        if not todo:
            return scores

        config = tuple(sorted(self.scorer_config.items()))
        backend = self._resolve_backend()
        items = [(gold, text) for _, gold, text in todo]
        if backend == "inline":
            scorer = cached_scorer(config)
            results: list[float | object | None] = [scorer.score(g, t) for g, t in items]
        elif backend == "signal":
            assert self.timeout_seconds is not None
            scorer = cached_scorer(config)
            results = _score_in_two_passes(
                lambda batch, timeout, deadline: score_with_alarm(scorer, batch, timeout, deadline),
                items,
                self.timeout_seconds,
            )
        else:
            assert self.timeout_seconds is not None
            pool = process_pool(json.dumps(dict(config), sort_keys=True))
            deaths: list[str] = []

            def score_on_pool(
                batch: Sequence[tuple[str, str]], timeout: float, deadline: float | None
            ) -> list[float | object | None]:
                batch_results, batch_deaths = pool.score_many(batch, timeout, self._num_workers(), deadline)
                deaths.extend(batch_deaths)
                return batch_results

            results = _score_in_two_passes(score_on_pool, items, self.timeout_seconds)
            if deaths:
                _warn_once(
                    "died",
                    f"{name}: a verification worker died ({deaths[0]}); that completion scored 0.0 "
                    "and the worker restarts on the next one.",
                )

        for (i, _, _), result in zip(todo, results):
            if result is DIED:
                scores[i] = 0.0
            elif result is TIMEOUT:
                _warn_once(
                    "timeout",
                    f"{name}: verifying a completion took longer than {self.timeout_seconds}s and it "
                    "scored 0.0 (this warning is shown once). Pathological answers such as huge powers "
                    "or factorials do this; raise make_math_accuracy(timeout_seconds=...) if correct "
                    "answers are being cut off.",
                )
                logger.debug("%s timed out on completion %d", name, i)
                scores[i] = 0.0
            else:
                scores[i] = result  # type: ignore[assignment]
        return scores


def make_math_accuracy(
    *,
    timeout_seconds: float | None = 5.0,
    backend: Backend = "auto",
    answer_column: str = "answer",
    float_rounding: int = 6,
    numeric_precision: int = 15,
    strict: bool = True,
    name: str = "math_accuracy",
    num_workers: int | None = None,
) -> RewardFunction:
    """A :func:`math_accuracy` with its own settings.

    Args:
        timeout_seconds: wall-clock budget per completion (parsing the gold answer and the completion, and
            comparing them); an item over budget scores 0.0 with a one-time warning. The items of one
            batch that overrun share one such budget: each item first gets a tenth of it (at least
            0.25 s), and those that overrun that are retried together under one deadline,
            ``timeout_seconds`` after the retry starts; an item still running then (or not yet started)
            scores 0.0 as a timeout. ``None`` disables
            the timeout and verifies in this thread, one item after another (only for trusted inputs:
            sympy can run for hours on e.g. ``9^{9^{9^9}}``).
        backend: how the timeout is enforced. ``"process"``: a pool of ``num_workers`` worker processes
            verifying a batch in parallel, one item per worker at a time (any thread; a worker takes
            about a second to start, once, then adds ~0.1 ms per item). A worker interrupts an item
            that overruns with its own timer and goes on; one stuck inside C code, out of the timer's
            reach, is killed shortly after the timeout and replaced. A batch then takes about
            ``(its normal work) / num_workers + ceil(P / num_workers) x timeout_seconds / 10 +
            timeout_seconds`` for ``P`` items that overrun (before the batch deadline: ``ceil(P /
            num_workers) x timeout_seconds``). ``"signal"``: a SIGALRM timer in this process, one item
            after another (main thread on POSIX only; no workers), so ``P`` overruns cost
            ``P x timeout_seconds / 10 + timeout_seconds``.
            ``"auto"`` (default): ``"process"``, or ``"signal"`` where possible when the pool would
            have a single worker.
        answer_column: the dataset column holding the gold answers.
        float_rounding, numeric_precision, strict: passed to ``math_verify.verify``.
        name: the function's ``__name__`` (its metrics name).
        num_workers: size of the process pool; ``None`` (default): the CPUs this process may use
            (``os.sched_getaffinity``) divided by the processes on this machine (``LOCAL_WORLD_SIZE``),
            capped at 16. Workers start on first use, are reused across calls (one pool per setting of
            ``float_rounding``/``numeric_precision``/``strict``) and are killed at exit.

    Example:
        >>> lenient = make_math_accuracy(timeout_seconds=2.0, answer_column="solution", name="acc")
        >>> lenient(None, [r"\\boxed{0.5}"], None, solution=[r"\\frac{1}{2}"])
        [1.0]
    """
    return _MathAccuracy(
        timeout_seconds=timeout_seconds,
        backend=backend,
        answer_column=answer_column,
        float_rounding=float_rounding,
        numeric_precision=numeric_precision,
        strict=strict,
        name=name,
        num_workers=num_workers,
    )


_DEFAULT_MATH_ACCURACY = make_math_accuracy()


def math_accuracy(
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None = None,
    answer: list[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 if a completion's final answer is mathematically equivalent to the gold ``answer``, else 0.0.

    Both sides go through Hugging Face's ``math-verify``: the gold answer is parsed as LaTeX or a plain
    expression; from the completion, its ``\\boxed{...}`` answer (or one introduced by "the final answer
    is ..."), and equivalence is symbolic and numeric (``\\frac{1}{2}`` equals ``0.5``, ``x^2+1`` equals
    ``1+x^2``). A number merely mentioned in the reasoning is not an answer: a completion with no final
    answer scores 0.0. Several boxed answers separated by commas are read as a set (math-verify's rule for
    multi-answer problems), so hedging between candidates is not rewarded. A row whose gold answer is
    missing or unparseable scores ``None`` (counted as 0 by :func:`compute_rewards`).

    Each completion has a 5-second budget (timeout -> 0.0 with a one-time warning), enforced in any
    thread; a batch is verified in parallel by a pool of worker processes, one per usable CPU (at most
    16), and its overrunning answers share one deadline, so pathological answers cost about one budget
    together, not one each; see
    :func:`make_math_accuracy` to change the budget, the pool size or the answer column. Needs the ``math`` extra:
    ``pip install "trl-sae[math]"``.

    Example:
        >>> math_accuracy(
        ...     prompts=["...", "...", "..."],
        ...     completions=[r"... so the answer is \\boxed{\\frac{1}{2}}", r"\\boxed{0.4}", "no idea"],
        ...     completion_ids=None,
        ...     answer=["0.5", "0.5", "0.5"],
        ... )
        [1.0, 0.0, 0.0]
    """
    return _DEFAULT_MATH_ACCURACY(prompts, completions, completion_ids, answer=answer, **kwargs)
