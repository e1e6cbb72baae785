"""Verifiable rewards: the reward-function protocol, weighted scoring, math accuracy and format rewards.

A reward function scores a batch of completions::

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

``columns`` are the dataset's other columns (e.g. ``answer``), each a list aligned with ``prompts``; the
trainer passes everything by keyword, as TRL does, so a function names the columns it needs and swallows
the rest with ``**kwargs``. ``None`` means "not applicable to this completion" and counts as 0.

:func:`compute_rewards` calls every function, checks what it returned and sums the weighted scores;
:func:`math_accuracy` grades final answers with Hugging Face's ``math-verify`` (never a home-made parser)
under a per-item timeout that also works outside the main thread; :func:`format_reward` checks that a
completion ends with exactly one ``\\boxed{...}`` answer.

This module imports only the standard library at import time (torch and math-verify are imported where
they are used) because :func:`math_accuracy`'s worker process loads this file on its own, without the
package, so that it starts in about a second.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import numbers
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "RewardTimeoutError",
    "compute_rewards",
    "format_reward",
    "make_format_reward",
    "make_math_accuracy",
    "math_accuracy",
    "reward_func_name",
    "validate_reward_funcs",
]

logger = logging.getLogger(__name__)

_MATH_VERIFY_HINT = 'math_accuracy needs math-verify, an optional extra: pip install "trl-sae[math]"'


# --------------------------------------------------------------------------------------------------
# The protocol and the weighted sum.
# --------------------------------------------------------------------------------------------------
@runtime_checkable
class RewardFunction(Protocol):
    """What the trainer calls to score a batch of ``B`` completions.

    Args:
        prompts: ``B`` prompts (text, or chat messages for conversational datasets).
        completions: ``B`` generated completions (decoded text, special tokens skipped).
        completion_ids: ``B`` lists of generated token ids (no padding).
        **columns: the dataset's other columns, each a list of ``B`` values aligned with ``prompts``.

    Returns:
        ``B`` scores; ``None`` marks a completion the function does not apply to (scored 0).

    Example:
        >>> def length_penalty(prompts, completions, completion_ids, **kwargs):
        ...     return [-0.001 * len(ids) for ids in completion_ids]
        >>> isinstance(length_penalty, RewardFunction)
        True
    """

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        **columns: Any,
    ) -> list[float | None]: ...


def reward_func_name(func: Callable[..., Any]) -> str:
    """The name a reward function is logged under (``reward/<name>/mean``).

    A function's ``__name__``; for a ``functools.partial``, the wrapped function's; for a callable object
    without ``__name__``, its class name.

    Example:
        >>> import functools
        >>> reward_func_name(functools.partial(format_reward))
        'format_reward'
    """
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name:
        return name
    return type(func).__name__


def _deduplicate_names(names: Sequence[str]) -> list[str]:
    # Two functions with one name would overwrite each other's metrics, so later ones get a suffix that
    # no other function already uses: ["f", "f", "f_2"] -> ["f", "f_3", "f_2"].
    taken = set(names)
    seen: set[str] = set()
    unique = []
    for name in names:
        if name in seen:
            k = 2
            while f"{name}_{k}" in taken:
                k += 1
            name = f"{name}_{k}"
            taken.add(name)
        seen.add(name)
        unique.append(name)
    return unique


def validate_reward_funcs(
    reward_funcs: Callable[..., Any] | str | Sequence[Callable[..., Any] | str],
    reward_weights: Sequence[float] | torch.Tensor | float | None = None,
) -> tuple[list[RewardFunction], list[str], torch.Tensor]:
    """Check reward functions and weights once, early (a trainer calls this in ``__init__``).

    Args:
        reward_funcs: one callable or a list of them. A string names a built-in from
            :data:`REWARD_FUNCTIONS` (handy in YAML recipes), e.g. ``"math_accuracy"``.
        reward_weights: one weight per function, or ``None`` for all 1.0.

    Returns:
        ``(funcs, names, weights)``: the functions as a list, their unique names, and a float32 tensor of
        shape ``(len(funcs),)``.

    Raises:
        ValueError: no functions, a non-callable, an unknown built-in name, a weight count that does not
            match, or a non-finite weight; the message names the argument and the fix.

    Example:
        >>> funcs, names, weights = validate_reward_funcs([math_accuracy, "format_reward"], [1.0, 0.1])
        >>> names, weights.tolist()
        (['math_accuracy', 'format_reward'], [1.0, 0.10000000149011612])
    """
    import torch

    if reward_funcs is None:
        raise ValueError("`reward_funcs` is None; pass at least one, e.g. reward_funcs=[math_accuracy].")
    if callable(reward_funcs) or isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    if not isinstance(reward_funcs, Sequence):
        raise ValueError(
            f"`reward_funcs` must be a callable or a list of callables, got {type(reward_funcs).__name__}."
        )
    if len(reward_funcs) == 0:
        raise ValueError("`reward_funcs` is empty; pass at least one, e.g. reward_funcs=[math_accuracy].")

    funcs: list[RewardFunction] = []
    for i, func in enumerate(reward_funcs):
        if isinstance(func, str):
            if func not in REWARD_FUNCTIONS:
                raise ValueError(
                    f"`reward_funcs[{i}]` is {func!r}, which is not a built-in reward function; "
                    f"known names: {sorted(REWARD_FUNCTIONS)}, or pass the callable itself."
                )
            func = REWARD_FUNCTIONS[func]
        if not callable(func):
            raise ValueError(
                f"`reward_funcs[{i}]` is a {type(func).__name__} ({_short_repr(func)}), not a callable; pass "
                "a function f(prompts, completions, completion_ids, **columns) -> list[float | None]."
            )
        funcs.append(func)
    names = _deduplicate_names([reward_func_name(f) for f in funcs])

    if reward_weights is None:
        weights = [1.0] * len(funcs)
    else:
        if isinstance(reward_weights, torch.Tensor):
            reward_weights = reward_weights.detach().reshape(-1).tolist()
        elif isinstance(reward_weights, numbers.Real):
            reward_weights = [reward_weights]
        if not isinstance(reward_weights, Sequence) or isinstance(reward_weights, str):
            raise ValueError(
                f"`reward_weights` must be a list of numbers (one per reward function) or None, got "
                f"{type(reward_weights).__name__}."
            )
        if len(reward_weights) != len(funcs):
            raise ValueError(
                f"`reward_weights` has {len(reward_weights)} entries but there are {len(funcs)} "
                f"`reward_funcs` ({names}); pass one weight per function, or None for equal weights."
            )
        weights = []
        for i, w in enumerate(reward_weights):
            if not isinstance(w, numbers.Real) or not math.isfinite(float(w)):
                raise ValueError(
                    f"`reward_weights[{i}]` (for {names[i]!r}) is {_short_repr(w)}; weights must be finite numbers."
                )
            weights.append(float(w))
    return funcs, names, torch.tensor(weights, dtype=torch.float32)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FLOAT32_MAX = 3.4028234663852886e38


def _check_reward_output(output: Any, name: str, num_completions: int) -> tuple[list[float], int]:
    """Validate one function's output and map ``None`` to 0.0; also return how many were not ``None``."""
    if not isinstance(output, (list, tuple)) and hasattr(output, "tolist"):
        output = output.tolist()  # a torch tensor or numpy array of shape (B,)
    if not isinstance(output, (list, tuple)):
        raise ValueError(
            f"reward function {name!r} returned a {type(output).__name__}; it must return a list of "
            f"{num_completions} floats (or None), one per completion."
        )
    if len(output) != num_completions:
        raise ValueError(
            f"reward function {name!r} returned {len(output)} values for {num_completions} completions; "
            "return exactly one value (a float, or None for 'not applicable') per completion."
        )
    values = []
    for i, value in enumerate(output):
        if value is None:
            values.append(0.0)
            continue
        if not isinstance(value, numbers.Real):
            raise ValueError(
                f"reward function {name!r} returned a non-numeric value {_short_repr(value)} "
                f"({type(value).__name__}) at index {i}; return a float, or None for 'not applicable'."
            )
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(
                f"reward function {name!r} returned {value} at index {i}; rewards must be finite "
                "(return None for 'not applicable')."
            )
        if abs(value) > _FLOAT32_MAX:
            # Rewards are float32 tensors from here on: this one would silently become inf.
            raise ValueError(
                f"reward function {name!r} returned {value:g} at index {i}, which overflows float32 "
                f"(|reward| <= {_FLOAT32_MAX:.3g}); rewards must be finite. Rescale the reward."
            )
        values.append(value)
    num_scored = sum(value is not None for value in output)
    return values, num_scored


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within ``reward_timeout`` seconds (see :func:`compute_rewards`)."""


def _call_reward_function(
    func: Callable[..., Any], name: str, kwargs: dict[str, Any], timeout: float | None
) -> Any:
    """Call ``func(**kwargs)``; with a ``timeout``, in a daemon thread that is abandoned if it overruns.

    Python cannot kill a thread, so a call that overruns is left running in its daemon thread (it holds
    on to its arguments and whatever it was doing, and dies with the process) while the caller gets a
    :class:`RewardTimeoutError` at once.
    """
    if timeout is None:
        return func(**kwargs)
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["output"] = func(**kwargs)
        except BaseException as error:  # handed to the caller's thread below
            box["error"] = error
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"trl-sae-reward-{name}", daemon=True)
    thread.start()
    if not done.wait(timeout):
        raise RewardTimeoutError(
            f"reward function {name!r} did not return within reward_timeout={timeout:g}s. The call cannot "
            f"be stopped (Python threads cannot be killed): it is abandoned, still running, in daemon thread "
            f"{thread.name!r} until it returns or the process exits, and its result will be ignored. Fix "
            "the function (e.g. bound its own work or network calls), or raise reward_timeout if it is "
            "just slow."
        )
    if "error" in box:
        error = box["error"]
        if hasattr(error, "add_note"):
            error.add_note(
                f"(reward function {name!r} ran in a worker thread because a reward timeout is set; code "
                "that needs the main thread, such as signal-based timeouts, fails there)"
            )
        raise error
    return box["output"]


_RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids")


def compute_rewards(
    reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any] | str],
    reward_weights: Sequence[float] | torch.Tensor | None,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    timeout: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score a batch with every reward function and sum the weighted scores.

    Each function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns)``; its
    output is checked (length ``B``, numbers or ``None``, finite in float32) and ``None`` becomes 0.

    Args:
        reward_funcs: as for :func:`validate_reward_funcs`.
        reward_weights: one weight per function, or ``None`` for all 1.0.
        prompts: ``B`` prompts.
        completions: ``B`` completions.
        completion_ids: ``B`` lists of completion token ids.
        columns: the dataset's other columns, each a list of ``B`` values.
        timeout: seconds each function's call may take, or ``None`` (default) for no limit. With a limit,
            each call runs in a fresh daemon thread and the caller waits at most ``timeout`` seconds; on
            overrun :class:`RewardTimeoutError` names the function. The overrunning call is *not* stopped
            (a Python thread cannot be killed): it keeps running in its abandoned daemon thread until it
            returns (its result is discarded) or the process exits. Functions that need the main thread
            (signal-based timeouts, e.g. ``math_verify.parse`` with its default ``parsing_timeout``) fail
            under a limit; :func:`math_accuracy` works in any thread.

    Returns:
        ``(total, per_function)``: ``total`` is a float32 tensor of shape ``(B,)``, ``sum_k w_k * r_k``;
        ``per_function`` maps each (unique) function name to its unweighted ``(B,)`` scores.

    Raises:
        ValueError: inconsistent batch lengths, a column named like a reserved argument, or a function
            that returned the wrong number of values, a non-number, NaN or inf, or a value or weighted
            sum that overflows float32 (the message names it).
        RewardTimeoutError: a function overran ``timeout`` (a :class:`TimeoutError`).

    Example:
        >>> total, per_function = compute_rewards(
        ...     [math_accuracy, format_reward], [1.0, 0.5],
        ...     prompts=["1+1?", "2+2?"], completions=[r"so \\boxed{2}", "5"], completion_ids=[[1], [2]],
        ...     columns={"answer": ["2", "4"]},
        ... )
        >>> total.tolist(), per_function["math_accuracy"].tolist()
        ([1.5, 0.0], [1.0, 0.0])
    """
    total, per_function, _ = _compute_rewards(
        reward_funcs, reward_weights, prompts, completions, completion_ids, columns, timeout=timeout
    )
    return total, per_function


def _compute_rewards(
    reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any] | str],
    reward_weights: Sequence[float] | torch.Tensor | None,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    timeout: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """:func:`compute_rewards`, also returning how many scores (over all functions) were not ``None``."""
    import torch

    if timeout is not None and not (
        isinstance(timeout, numbers.Real) and math.isfinite(timeout) and timeout > 0
    ):
        raise ValueError(f"`timeout` must be a positive number of seconds or None, got {timeout!r}.")
    funcs, names, weights = validate_reward_funcs(reward_funcs, reward_weights)
    num = len(prompts)
    if len(completions) != num:
        raise ValueError(f"`completions` has {len(completions)} entries for {num} `prompts`; pass one each.")
    if completion_ids is not None and len(completion_ids) != num:
        raise ValueError(f"`completion_ids` has {len(completion_ids)} entries for {num} `prompts`.")
    columns = dict(columns or {})
    for key, values in columns.items():
        if key in _RESERVED_ARGUMENTS:
            raise ValueError(
                f"dataset column {key!r} clashes with the reward-function argument of the same name; rename it."
            )
        if len(values) != num:
            raise ValueError(
                f"column {key!r} has {len(values)} values for {num} prompts; columns must align."
            )

    total = torch.zeros(num, dtype=torch.float32)
    per_function: dict[str, torch.Tensor] = {}
    num_scored = 0
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    for func, name, weight in zip(funcs, names, weights.tolist()):
        try:
            output = _call_reward_function(func, name, kwargs, timeout)
        except RewardTimeoutError:
            raise
        except Exception as error:
            # The traceback points inside the user's function; the note says which one in the list it was.
            if hasattr(error, "add_note"):
                error.add_note(f"(raised by reward function {name!r})")
            raise
        values, scored = _check_reward_output(output, name, num)
        num_scored += scored
        scores = torch.tensor(values, dtype=torch.float32)
        per_function[name] = scores
        total += weight * scores
    if not torch.isfinite(total).all():
        index = int((~torch.isfinite(total)).nonzero()[0])
        raise ValueError(
            f"the weighted sum of rewards is {total[index].item()} at index {index} (float32 overflow): "
            + ", ".join(
                f"{n}={per_function[n][index].item():g} x {w:g}" for n, w in zip(names, weights.tolist())
            )
            + "; rescale the rewards or reward_weights."
        )
    return total, per_function, num_scored


# --------------------------------------------------------------------------------------------------
# Completion text helpers.
# --------------------------------------------------------------------------------------------------
def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    # Multimodal message content: a list of {"type": "text", "text": ...} parts.
    return "".join(part.get("text") or "" for part in content if isinstance(part, Mapping))


def _completion_text(completion: Any) -> str:
    """Text of a completion: a string, a message, or the last message of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _message_text(completion)
    if isinstance(completion, Sequence) and all(isinstance(m, Mapping) for m in completion):
        return _message_text(completion[-1]) if completion else ""
    raise ValueError(
        f"a completion is a {type(completion).__name__}; expected text or a list of chat messages "
        '({"role": ..., "content": ...}).'
    )


_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def _final_part(text: str) -> str | None:
    """The part of a completion after its reasoning; ``None`` if the reasoning never closed."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    if _THINK_OPEN in text:
        return None  # truncated inside <think>: there is no final answer yet
    return text


_BOXED_RE = re.compile(r"\\boxed\s*\{")


def _boxed_answers(text: str) -> list[str | None]:
    """Contents of every ``\\boxed{...}`` in ``text``; ``None`` for one whose braces never close."""
    answers: list[str | None] = []
    for match in _BOXED_RE.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            char = text[i]
            if char == "\\":
                i += 2  # an escaped brace (\{ or \}) is content, not structure
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
            i += 1
        answers.append(text[match.end() : i - 1] if depth == 0 else None)
    return answers


# --------------------------------------------------------------------------------------------------
# Format rewards.
# --------------------------------------------------------------------------------------------------
def format_reward(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """1.0 if a completion gives exactly one final answer in ``\\boxed{...}`` after any reasoning, else 0.0.

    "After any reasoning" means after the last ``</think>`` when there is one; a completion that opens
    ``<think>`` and never closes it has no final answer (0.0). The boxed answer must have balanced braces
    (``\\{`` and ``\\}`` count as content) and be non-empty, and there must be exactly one of them.

    Example:
        >>> format_reward(None, [
        ...     r"<think>1+1 is 2</think> The answer is \\boxed{2}.",
        ...     r"\\boxed{\\frac{1}{2}}",
        ...     r"\\boxed{1} or \\boxed{2}",
        ...     r"<think>still thinking \\boxed{2}",
        ...     r"\\boxed{2",
        ...     "2",
        ... ])
        [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    """
    scores = []
    for completion in completions:
        final = _final_part(_completion_text(completion))
        answers = _boxed_answers(final) if final is not None else []
        ok = len(answers) == 1 and answers[0] is not None and answers[0].strip() != ""
        scores.append(1.0 if ok else 0.0)
    return scores


def make_format_reward(
    pattern: str | re.Pattern[str], *, flags: int = re.DOTALL, name: str = "format_reward"
) -> RewardFunction:
    """A reward function scoring 1.0 when ``pattern`` is found in a completion (``re.search``), else 0.0.

    Anchor the pattern (``^...$`` or ``\\A...\\Z``) to require that the whole completion matches.

    Args:
        pattern: a regular expression (string or compiled).
        flags: ``re`` flags for a string pattern; ``re.DOTALL`` by default so ``.`` spans lines.
        name: the function's ``__name__``, which is the name its metrics are logged under.

    Raises:
        ValueError: the pattern does not compile.

    Example:
        >>> think_format = make_format_reward(r"^<think>.+</think>\\s*\\S", name="think_format")
        >>> think_format(None, ["<think>so</think> 4", "4"])
        [1.0, 0.0]
    """
    if isinstance(pattern, str):
        try:
            compiled = re.compile(pattern, flags)
        except re.error as error:
            raise ValueError(f"`pattern` {pattern!r} is not a valid regular expression: {error}") from error
    else:
        compiled = pattern

    def reward(
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        return [1.0 if compiled.search(_completion_text(c)) else 0.0 for c in completions]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"1.0 if the completion matches {compiled.pattern!r} (re.search), else 0.0."
    return reward


# --------------------------------------------------------------------------------------------------
# Math accuracy: math-verify under a per-item timeout.
#
# math-verify's own timeout is signal.alarm(), which raises in threads that are not the main thread, has
# whole-second resolution and cancels any other SIGALRM timer (pytest-timeout's, for one). So we pass it
# no timeout and bound each item ourselves:
#   * "signal" (the main thread on POSIX): a SIGALRM interval timer around each item, raising an exception
#     derived from BaseException so that the `except Exception` blocks of math-verify and sympy cannot
#     swallow it; an outer SIGALRM timer is paused and re-armed with its remaining time afterwards.
#   * "process" (any thread): items go to a pool of long-lived worker processes over pipes, one item per
#     worker at a time, so a batch is verified in parallel. A worker stops an overrunning item with its
#     own SIGALRM timer and carries on; one stuck where that cannot reach it (inside C code) is killed
#     and replaced.
# "auto" picks "process" when the pool would have more than one worker, else "signal" where it can.
# --------------------------------------------------------------------------------------------------
_TIMEOUT = object()  # sentinel result: the item ran out of time


class _ItemTimeout(BaseException):
    """Raised by the SIGALRM handler when an item overruns its budget."""


def _raise_item_timeout(signum: int, frame: Any) -> None:
    raise _ItemTimeout


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns "Timeout is disabled ..." when called without its own timeout; ours is on.
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(_MATH_VERIFY_HINT) from error
    log_filter = _DropTimeoutDisabledWarning()
    for logger_name in ("math_verify.parser", "math_verify.grader"):
        mv_logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _DropTimeoutDisabledWarning) for f in mv_logger.filters):
            mv_logger.addFilter(log_filter)
    return math_verify


class _MathScorer:
    """Parse the gold answer and a completion's final answer with math-verify and compare them.

    No timeout of its own: the caller bounds each :meth:`score` call.
    """

    _GOLD_CACHE_SIZE = 4096

    def __init__(self, float_rounding: int = 6, numeric_precision: int = 15, strict: bool = True) -> None:
        mv = _import_math_verify()
        self._parse = mv.parse
        self._verify = mv.verify
        self._verify_kwargs = {
            "float_rounding": float_rounding,
            "numeric_precision": numeric_precision,
            "strict": strict,
        }
        # Gold answers are bare (e.g. "34", "\frac{1}{2}", "x^2+1"): try LaTeX, then a plain expression.
        self._gold_config = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
        # Completions: the final answer only. A \boxed{} comes first; anchors such as "the final answer
        # is" also count, but a number merely mentioned in the reasoning does not.
        self._completion_config = [
            mv.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
            mv.ExprExtractionConfig(try_extract_without_anchor=False),
        ]
        self._gold_cache: dict[str, list[Any]] = {}

    def parse_gold(self, gold: str) -> list[Any]:
        cached = self._gold_cache.get(gold)
        if cached is None:
            text = gold.strip()
            # Inside $...$ the LaTeX extractor reads the whole answer ("2\pi", "10^{10}") instead of its
            # first number, as it would in running text.
            if text and "$" not in text and "\\boxed" not in text:
                text = f"${text}$"
            cached = self._parse(text, self._gold_config, extraction_mode="first_match", parsing_timeout=None)
            if len(self._gold_cache) >= self._GOLD_CACHE_SIZE:
                self._gold_cache.clear()
            self._gold_cache[gold] = cached
        return cached

    def warm_up(self) -> None:
        """Parse once, so math-verify's lazy imports (~0.3 s) do not count against a real item's timeout."""
        self.parse_gold("1")
        self._parse(
            r"\boxed{\frac{1}{2}}",
            self._completion_config,
            extraction_mode="first_match",
            parsing_timeout=None,
        )

    def score(self, gold: str, completion: str) -> float | None:
        """1.0 / 0.0, or ``None`` when the gold answer cannot be parsed."""
        gold_parsed = self.parse_gold(gold)
        if not gold_parsed:
            return None
        predicted = self._parse(
            completion, self._completion_config, extraction_mode="first_match", parsing_timeout=None
        )
        if not predicted:
            return 0.0
        return (
            1.0 if self._verify(gold_parsed, predicted, timeout_seconds=None, **self._verify_kwargs) else 0.0
        )


@functools.lru_cache(maxsize=8)
def _scorer(config: tuple[tuple[str, Any], ...]) -> _MathScorer:
    return _MathScorer(**dict(config))


def _signal_backend_available() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        # None: a handler installed from C, which Python could not restore afterwards.
        and signal.getsignal(signal.SIGALRM) is not None
    )


def _score_with_alarm(
    scorer: _MathScorer, items: list[tuple[str, str]], timeout_seconds: float
) -> list[float | object | None]:
    """Score items in this (main) thread, each under a SIGALRM interval timer."""
    previous_handler = signal.signal(signal.SIGALRM, _raise_item_timeout)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, 0)  # pause an outer timer
    started = time.monotonic()
    results: list[float | object | None] = []
    try:
        for gold, completion in items:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_seconds)
                try:
                    result: float | object | None = scorer.score(gold, completion)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except _ItemTimeout:
                result = _TIMEOUT
            results.append(result)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:
            # Re-arm the outer timer with what it had left (at least a moment, so an expired one fires).
            remaining = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), previous_interval)
    return results


# The worker runs this file as a standalone module (not through the package, whose __init__ imports
# torch and TRL) and serves JSON lines: {"gold", "completion"} -> {"score"} or {"error"}.
_WORKER_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_trl_sae_math_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(sys.argv[2])\n"
)


def _worker_command(config_json: str) -> list[str]:
    """The worker's command line (a function so tests can substitute a misbehaving worker)."""
    return [sys.executable, "-c", _WORKER_BOOTSTRAP, os.path.abspath(__file__), config_json]


def _worker_main(config_json: str) -> None:
    """Entry point of the worker process: score requests from stdin until it closes."""
    protocol = sys.stdout
    sys.stdout = sys.stderr  # a stray print() must not corrupt the protocol stream
    try:
        scorer = _MathScorer(**json.loads(config_json))
        scorer.warm_up()
    except Exception as error:
        protocol.write(json.dumps({"ready": False, "error": f"{type(error).__name__}: {error}"}) + "\n")
        protocol.flush()
        return
    # Each item runs under two timers (POSIX):
    #  * soft, wall clock: SIGALRM raises _ItemTimeout at the item's timeout, as in the "signal" backend;
    #    the worker replies {"timeout": true} and lives on, so a pathological answer costs its timeout
    #    and no restart (~1 s of imports);
    #  * backstop, CPU time: code that never returns to Python (a hang inside C) cannot see the soft
    #    timer, so the parent kills the worker shortly after the timeout; and if the parent is gone
    #    (SIGKILLed: no atexit, and stdin is only read between items), SIGPROF's default action ends
    #    the worker after `_WORKER_SELF_KILL_FACTOR x timeout + 1` seconds of CPU.
    timers = hasattr(signal, "setitimer")
    if timers:
        signal.signal(signal.SIGALRM, _raise_item_timeout)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
    protocol.write(json.dumps({"ready": True}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        timeout = request.get("timeout")
        armed = bool(timers and timeout)
        try:
            try:
                if armed:
                    signal.setitimer(signal.ITIMER_PROF, _WORKER_SELF_KILL_FACTOR * timeout + 1.0)
                    signal.setitimer(signal.ITIMER_REAL, timeout)
                response: dict[str, Any] = {"score": scorer.score(request["gold"], request["completion"])}
            finally:
                if armed:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.setitimer(signal.ITIMER_PROF, 0)
        except _ItemTimeout:
            response = {"timeout": True}
        except Exception as error:
            response = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(response) + "\n")
        protocol.flush()


_WORKER_SELF_KILL_FACTOR = 2.0


def _kill_grace(timeout_seconds: float) -> float:
    """How long after an item's timeout the parent waits for the worker's own timer before killing it."""
    return min(1.0, 0.2 * timeout_seconds) + 0.1


class _WorkerDied(RuntimeError):
    pass


class _ProcessVerifier:
    """A long-lived worker process scoring one item at a time; killed and restarted on a timeout."""

    def __init__(self, config_json: str, startup_timeout: float = 120.0) -> None:
        self._config_json = config_json
        self._startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._responses: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._owner_pid = os.getpid()
        self._closed = False

    @staticmethod
    def _pump(stream: Any, responses: queue.SimpleQueue[dict[str, Any] | None]) -> None:
        # A reader thread turns the worker's stdout into a queue, so waiting for a reply can time out on
        # every platform (select() does not work on pipes on Windows).
        try:
            for line in stream:
                try:
                    responses.put(json.loads(line))
                except ValueError:
                    logger.debug("math_accuracy worker wrote a non-protocol line: %r", line)
        except (OSError, ValueError):
            pass  # the pipe was closed under us: the worker is being killed
        responses.put(None)  # EOF: the worker exited

    def _start(self) -> None:
        proc = subprocess.Popen(
            _worker_command(self._config_json),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            bufsize=1,
        )
        responses: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(
            target=self._pump, args=(proc.stdout, responses), name="trl-sae-math-verify-reader", daemon=True
        ).start()
        self._proc, self._responses = proc, responses
        try:
            ready = responses.get(timeout=self._startup_timeout)
        except queue.Empty:
            ready = {"ready": False, "error": f"no answer within {self._startup_timeout}s"}
        if not ready or not ready.get("ready"):
            self._kill()
            error = (ready or {}).get("error", "it exited during start-up")
            if error.startswith("ImportError"):
                raise ImportError(_MATH_VERIFY_HINT)
            raise RuntimeError(f"math_accuracy's verification worker failed to start: {error}")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def _ensure_started_locked(self) -> None:
        if os.getpid() != self._owner_pid:
            # A forked copy of this object: the pipes belong to the parent, so start our own worker.
            self._proc, self._owner_pid = None, os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()

    @property
    def running(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None and os.getpid() == self._owner_pid

    def ensure_started(self) -> None:
        """Start the worker if it is not running (used to replace a killed one ahead of the next batch)."""
        with self._lock:
            if not self._closed:
                self._ensure_started_locked()

    def score(self, gold: str, completion: str, timeout_seconds: float | None) -> float | object | None:
        with self._lock:
            self._ensure_started_locked()
            assert self._proc is not None and self._proc.stdin is not None
            request = {"gold": gold, "completion": completion, "timeout": timeout_seconds}
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                # The worker stops the item itself at `timeout_seconds` (and says so); a worker that has
                # not answered a little later is stuck where its timer cannot reach: kill it.
                wait = None if timeout_seconds is None else timeout_seconds + _kill_grace(timeout_seconds)
                response = self._responses.get(timeout=wait)
            except queue.Empty:
                self._kill()
                return _TIMEOUT
            except OSError as error:  # broken pipe: the worker died between items
                self._kill()
                raise _WorkerDied(str(error)) from error
            if response is None:
                try:
                    code = self._proc.wait(timeout=5.0) if self._proc is not None else None
                except subprocess.TimeoutExpired:
                    code = None
                self._kill()
                if hasattr(signal, "SIGPROF") and code == -signal.SIGPROF:
                    return _TIMEOUT  # its own backstop timer fired before we killed it (a loaded machine)
                raise _WorkerDied(f"the worker exited (code {code}), e.g. out of memory")
            if response.get("timeout"):
                return _TIMEOUT
            if "error" in response:
                logger.debug("math_accuracy worker error: %s", response["error"])
                return 0.0
            return response["score"]

    def close(self) -> None:
        # The worker holds no state worth a graceful exit (sympy's shutdown alone takes ~0.5 s).
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # at once, even while another thread holds the lock waiting for its start-up
        with self._lock:
            self._kill()


_DIED = object()  # sentinel result: the worker died on the item (e.g. out of memory)

# Workers in a default pool: one per CPU this process may use, shared among the processes of one
# machine (torchrun/accelerate set LOCAL_WORLD_SIZE), at most this many: each worker holds ~60-100 MB,
# and a batch of a few hundred answers gains little from more.
_MAX_DEFAULT_WORKERS = 16


def _default_num_workers() -> int:
    """Verification workers for this process: its usable CPUs / processes on this machine, in [1, 16]."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_processes = 1
    return max(1, min(cpus // local_processes, _MAX_DEFAULT_WORKERS))


class _VerifierPool:
    """Up to N :class:`_ProcessVerifier` workers sharing a batch, each taking the next unscored item.

    A batch of ``B`` items on ``n`` workers takes about ``(normal work) / n + ceil(P / n) x timeout`` for
    ``P`` items that overrun the timeout: a worker interrupts such an item itself and takes the next one.
    Only a worker stuck where its timer cannot reach (inside C code) is killed, ``_kill_grace`` after
    the timeout, and replaced (~1 s: a new interpreter importing sympy and math-verify) before it takes
    another item, or in the background once the batch is done, so the next batch does not wait for it.
    """

    def __init__(self, config_json: str) -> None:
        self._config_json = config_json
        self._lock = threading.Lock()
        self._verifiers: list[_ProcessVerifier] = []

    def _take(self, n: int) -> list[_ProcessVerifier]:
        with self._lock:
            while len(self._verifiers) < n:
                self._verifiers.append(_ProcessVerifier(self._config_json))
            return self._verifiers[:n]

    def score_many(
        self, items: Sequence[tuple[str, str]], timeout_seconds: float | None, num_workers: int
    ) -> tuple[list[float | object | None], list[str]]:
        """Score ``items`` on up to ``num_workers`` workers; returns results (or sentinels) and death notes."""
        results: list[float | object | None] = [None] * len(items)
        if not items:
            return results, []
        verifiers = self._take(max(1, min(num_workers, len(items))))
        state = {"next": 0, "done": 0}
        state_lock = threading.Lock()
        finished = threading.Event()
        errors: list[BaseException] = []
        deaths: list[str] = []

        def take() -> int | None:
            with state_lock:
                if errors or state["next"] >= len(items):
                    return None
                state["next"] += 1
                return state["next"] - 1

        def drive(verifier: _ProcessVerifier) -> None:
            try:
                while True:
                    if not verifier.running:
                        # Start (or replace a killed) worker *before* taking an item, so the items left
                        # go to the workers that are up in the meantime.
                        verifier.ensure_started()
                    index = take()
                    if index is None:
                        break
                    gold, completion = items[index]
                    try:
                        results[index] = verifier.score(gold, completion, timeout_seconds)
                    except _WorkerDied as error:
                        deaths.append(str(error))
                        results[index] = _DIED
                    with state_lock:
                        state["done"] += 1
                        if state["done"] == len(items):
                            finished.set()
            except BaseException as error:  # a start-up failure: handed to the caller
                with state_lock:
                    errors.append(error)
                finished.set()
                return
            # Replace a worker killed on this batch now, not at the start of the next one. The caller
            # does not wait for this: it returns as soon as every item has a result.
            if not verifier.running:
                try:
                    verifier.ensure_started()
                except Exception as error:  # reported when the next batch tries again
                    logger.debug("math_accuracy worker restart failed: %s", error)

        for verifier in verifiers:
            threading.Thread(target=drive, args=(verifier,), name="trl-sae-math-verify", daemon=True).start()
        finished.wait()
        if errors:
            raise errors[0]
        return results, deaths

    def close(self) -> None:
        with self._lock:
            verifiers, self._verifiers = self._verifiers, []
        for verifier in verifiers:
            verifier.close()


_PROCESS_POOLS: dict[str, _VerifierPool] = {}
_PROCESS_POOLS_LOCK = threading.Lock()


def _process_pool(config_json: str) -> _VerifierPool:
    with _PROCESS_POOLS_LOCK:
        pool = _PROCESS_POOLS.get(config_json)
        if pool is None:
            pool = _PROCESS_POOLS[config_json] = _VerifierPool(config_json)
        return pool


@atexit.register
def _close_process_verifiers() -> None:
    """Kill every verification worker (at exit; tests call it to start afresh)."""
    with _PROCESS_POOLS_LOCK:
        pools = list(_PROCESS_POOLS.values())
        _PROCESS_POOLS.clear()
    for pool in pools:
        pool.close()


def _warn_zero_reward(reason: str) -> None:
    """Say loudly, in the log and as a warning, that a run is training on zero reward (callers warn once)."""
    message = f"Training on zero reward: {reason}"
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _gold_text(value: Any) -> str | None:
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
        return self.num_workers if self.num_workers is not None else _default_num_workers()

    def _resolve_backend(self) -> str:
        if self.timeout_seconds is None:
            return "inline"
        if self.backend == "signal" and not _signal_backend_available():
            raise RuntimeError(
                "math_accuracy backend='signal' needs the main thread on a POSIX system; use "
                "backend='process' (or 'auto') from other threads."
            )
        if self.backend == "auto":
            # Several workers verify a batch in parallel; with one, the in-process timer is cheaper.
            return "signal" if self._num_workers() == 1 and _signal_backend_available() else "process"
        return self.backend

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        name = self.__name__
        if self.answer_column not in columns or columns[self.answer_column] is None:
            raise ValueError(
                f"{name} needs the gold answers in a dataset column named {self.answer_column!r}; the batch "
                f"has columns {sorted(columns)}. Rename the column or use "
                f"make_math_accuracy(answer_column=...)."
            )
        golds = columns[self.answer_column]
        if len(golds) != len(completions):
            raise ValueError(
                f"{name}: column {self.answer_column!r} has {len(golds)} values for {len(completions)} completions."
            )
        texts = [_completion_text(c) for c in completions]
        gold_texts = [_gold_text(g) for g in golds]
        todo = [(i, gold, text) for i, (gold, text) in enumerate(zip(gold_texts, texts)) if gold is not None]
        scores: list[float | None] = [None] * len(completions)
        if not todo:
            return scores

        config = tuple(sorted(self.scorer_config.items()))
        backend = self._resolve_backend()
        items = [(gold, text) for _, gold, text in todo]
        if backend == "inline":
            scorer = _scorer(config)
            results: list[float | object | None] = [scorer.score(g, t) for g, t in items]
        elif backend == "signal":
            assert self.timeout_seconds is not None
            results = _score_with_alarm(_scorer(config), items, self.timeout_seconds)
        else:
            pool = _process_pool(json.dumps(dict(config), sort_keys=True))
            results, deaths = pool.score_many(items, self.timeout_seconds, self._num_workers())
            if deaths:
                _warn_once(
                    "died",
                    f"{name}: a verification worker died ({deaths[0]}); that completion scored 0.0 "
                    "and the worker restarts on the next one.",
                )

        for (i, _, _), result in zip(todo, results):
            if result is _DIED:
                scores[i] = 0.0
            elif result is _TIMEOUT:
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
            comparing them); an item over budget scores 0.0 with a one-time warning. ``None`` disables
            the timeout and verifies in this thread, one item after another (only for trusted inputs:
            sympy can run for hours on e.g. ``9^{9^{9^9}}``).
        backend: how the timeout is enforced. ``"process"``: a pool of ``num_workers`` worker processes
            verifying a batch in parallel, one item per worker at a time (any thread; a worker takes
            about a second to start, once, then adds ~0.1 ms per item). A worker interrupts an item
            that overruns with its own timer and goes on; one stuck inside C code, out of the timer's
            reach, is killed shortly after the timeout and replaced. A batch then takes about
            ``(its normal work) / num_workers + ceil(P / num_workers) x timeout_seconds`` for ``P``
            items that overrun. ``"signal"``: a SIGALRM timer in this process, one item after another
            (main thread on POSIX only; no workers), so ``P`` overruns cost ``P x timeout_seconds``.
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
    16), so a few pathological answers cost about one budget, not one each; see
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


#: Built-in reward functions by name (``reward_funcs=["math_accuracy"]`` in recipes and the CLI).
REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_accuracy": math_accuracy,
    "format_reward": format_reward,
}
