"""What every reward function is built from: the :class:`RewardFunction` protocol, a completion's text, and
a batch's dataset column and the rows that have a gold.

The built-in rewards (``math``, ``format``, ``code``, ...) take these from here, the registry imports the
rewards, and :mod:`trl_sae.rewards.protocol` (the weighted sum, which resolves built-in names through the
registry) sits above them all and re-exports the protocol and ``completion_text``: imports go one way,
with no circle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["RewardFunction", "completion_text", "graded_rows", "required_column"]

_Gold = TypeVar("_Gold")


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


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    # Multimodal message content: a list of {"type": "text", "text": ...} parts.
    return "".join(part.get("text") or "" for part in content if isinstance(part, Mapping))


def completion_text(completion: Any) -> str:
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


def required_column(
    columns: Mapping[str, Any],
    column: str,
    *,
    reward: str,
    holds: str,
    fix: str,
    num_completions: int | None = None,
) -> Sequence[Any]:
    """The batch's ``column``, or a ``ValueError`` naming the reward, what the column holds and the fix.

    Args:
        columns: the batch's dataset columns (a reward function's ``**columns``).
        column: the column the reward reads.
        reward: the reward's name (its ``__name__``), which starts the message.
        holds: what the column holds, e.g. ``"the gold answers"``.
        fix: the message's last sentence, e.g. ``"Use make_science_accuracy(answer_column=...)."``.
        num_completions: when given, the column must have one value per completion.

    Example:
        >>> required_column({"answer": ["4"]}, "answer", reward="r", holds="the gold answers", fix="")
        ['4']
        >>> required_column({"gold": ["4"]}, "answer", reward="r", holds="the gold answers", fix="Rename it.")
        Traceback (most recent call last):
        ValueError: r needs the gold answers in a dataset column named 'answer'; the batch has columns ['gold']. Rename it.
    """
    values = columns.get(column)
    if values is None:
        # A built-in's own signature names its column (`answer=None`), so a None there is no column.
        present = sorted(name for name, value in columns.items() if value is not None)
        raise ValueError(
            f"{reward} needs {holds} in a dataset column named {column!r}; the batch has columns {present}. {fix}"
        )
    if num_completions is not None and len(values) != num_completions:
        raise ValueError(
            f"{reward}: column {column!r} has {len(values)} values for {num_completions} completions."
        )
    return values


def graded_rows(
    completions: Sequence[Any], golds: Sequence[Any], gold: Callable[[Any, int], _Gold | None]
) -> Iterator[tuple[int, str, _Gold]]:
    """``(index, completion text, gold)`` for each row with a gold: rows whose ``gold(value, index)`` is
    ``None`` are left out (the reward scores them ``None``), and their completions are not read.

    ``golds`` must be as long as ``completions`` (``ValueError`` otherwise).

    Example:
        >>> list(graded_rows(["a", "b"], ["1", None], lambda value, i: value))
        [(0, 'a', '1')]
    """
    for i, (completion, value) in enumerate(zip(completions, golds, strict=True)):
        parsed = gold(value, i)
        if parsed is not None:
            yield i, completion_text(completion), parsed
