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

from collections.abc import Callable
from typing import Any

from trl_sae.gym import ENTRY_COLUMN, GENERATOR_KEY, generator_settings, gym_entry
from trl_sae.rewards.protocol import completion_text

__all__ = ["extract_tagged_answer", "reasoning_gym_accuracy"]


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


def reasoning_gym_accuracy(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **columns: Any
) -> list[float]:
    """The task's ``score_answer`` (in [0, 1]) of each completion's ``<answer>`` content.

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
        score = _score_answer(entry)(answer, task_entry)
        scores.append(float(score))
    return scores
