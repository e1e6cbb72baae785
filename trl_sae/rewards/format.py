"""Format rewards: exactly one final ``\\boxed{...}`` answer after any reasoning, or a regular expression."""

from __future__ import annotations

import re
from typing import Any

from trl_sae.rewards.base import RewardFunction, completion_text

__all__ = ["boxed_answers", "final_part", "format_reward", "make_format_reward"]


_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def final_part(text: str) -> str | None:
    """The part of a completion after its reasoning; ``None`` if the reasoning never closed."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    if _THINK_OPEN in text:
        return None  # truncated inside <think>: there is no final answer yet
    return text


_BOXED_RE = re.compile(r"\\boxed\s*\{")


def boxed_answers(text: str) -> list[str | None]:
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
        final = final_part(completion_text(completion))
        answers = boxed_answers(final) if final is not None else []
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
        return [1.0 if compiled.search(completion_text(c)) else 0.0 for c in completions]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"1.0 if the completion matches {compiled.pattern!r} (re.search), else 0.0."
    return reward
