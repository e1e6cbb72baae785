"""The reward-function protocol and the weighted sum of rewards, with a per-call timeout.

A reward function scores a batch of completions::

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

``columns`` are the dataset's other columns (e.g. ``answer``), each a list aligned with ``prompts``; the
trainer passes everything by keyword, as TRL does, so a function names the columns it needs and swallows
the rest with ``**kwargs``. ``None`` means "not applicable to this completion" and counts as 0.

:func:`compute_rewards` calls every function, checks what it returned and sums the weighted scores. The
built-in functions are in :mod:`trl_sae.rewards.math` (math accuracy graded by math-verify) and
:mod:`trl_sae.rewards.format` (format rewards); :data:`trl_sae.rewards.registry.REWARD_FUNCTIONS` names them.
:class:`RewardFunction` and :func:`completion_text` are defined in :mod:`trl_sae.rewards.base`, which the
rewards import (this module resolves names through the registry, so it sits above them) and re-exported here.

torch is imported where it is used, so importing this module stays cheap.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trl_sae.rewards.base import RewardFunction, completion_text

if TYPE_CHECKING:
    import torch

__all__ = [
    "RewardFunction",
    "RewardFunctionError",
    "RewardTimeoutError",
    "completion_text",
    "compute_rewards",
    "compute_rewards_and_count",
    "reward_func_name",
    "validate_reward_funcs",
    "warn_zero_reward",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# The weighted sum (RewardFunction and completion_text are defined in rewards.base, below the rewards).
# --------------------------------------------------------------------------------------------------
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

    # Imported here so that importing this module stays cheap: the registry imports every built-in reward.
    from trl_sae.rewards.registry import REWARD_FUNCTIONS

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


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it and the error, which is the ``__cause__``."""


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
        RewardFunctionError: a function raised; the message names it, the original error is its
            ``__cause__``.
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
    total, per_function, _ = compute_rewards_and_count(
        reward_funcs, reward_weights, prompts, completions, completion_ids, columns, timeout=timeout
    )
    return total, per_function


def compute_rewards_and_count(
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
            # A bare `KeyError: 'answer'` says nothing of which function in the list raised it (the CLI and
            # other ranks show one line); the original stays the cause, with its traceback inside the function.
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(error).__name__}: {error}"
            ) from error
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


def warn_zero_reward(reason: str) -> None:
    """Say loudly, in the log and as a warning, that a run is training on zero reward (callers warn once)."""
    message = f"Training on zero reward: {reason}"
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
