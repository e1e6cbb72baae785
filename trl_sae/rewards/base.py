"""What every reward function is built from: the :class:`RewardFunction` protocol and a completion's text.

The built-in rewards (``math``, ``format``, ``code``, ...) take these from here, the registry imports the
rewards, and :mod:`trl_sae.rewards.protocol` (the weighted sum, which resolves built-in names through the
registry) sits above them all and re-exports both names: imports go one way, with no circle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["RewardFunction", "completion_text"]


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
