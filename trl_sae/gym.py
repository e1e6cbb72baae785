"""reasoning-gym tasks as prompt datasets: procedurally generated reasoning problems with their own verifiers,
offline (``pip install 'trl-sae[gym]'``).

:func:`load_reasoning_gym` turns a task (``chain_sum``, ``basic_arithmetic``, ``countdown``, ``gsm_symbolic``,
...) into the trainer's dataset: a ``prompt`` column (chat messages, or plain text) and the task's entry
as JSON in :data:`ENTRY_COLUMN`, which :func:`trl_sae.rewards.reasoning_gym.reasoning_gym_accuracy` hands
to the task's own ``score_answer``. The entry also carries the generator's settings
(:data:`GENERATOR_KEY`): a verifier reads its task's settings (``decimal_arithmetic``'s tolerance is
``10 ** -max_num_decimal_places``), so each row is scored by a generator built as the one that made it.

The answer format is stated in every prompt (:data:`ANSWER_INSTRUCTION`): the final answer inside
``<answer>...</answer>`` tags, reasoning-gym's own convention (``reasoning_gym.utils.extract_answer``).

A recipe names a task as ``dataset_name: reasoning_gym:<task>`` (:func:`parse_gym_name`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "ANSWER_INSTRUCTION",
    "ENTRY_COLUMN",
    "GENERATOR_KEY",
    "GYM_PREFIX",
    "HELD_OUT_SEED_OFFSET",
    "chain_steps",
    "generator_settings",
    "gym_entry",
    "load_reasoning_gym",
    "parse_gym_name",
]

#: The dataset column holding each row's reasoning-gym entry (question, answer, metadata) as JSON.
ENTRY_COLUMN = "reasoning_gym_entry"
#: Key of an entry's generator settings (``seed``, ``size`` and the task's ``config``) in the entry column.
GENERATOR_KEY = "trl_sae_generator"
#: ``dataset_name`` prefix that selects a reasoning-gym task in recipes.
GYM_PREFIX = "reasoning_gym:"
#: Appended to every question: the format the reward extracts the answer from.
# (No example number: SmolLM2-135M answered "42" to every question when the instruction showed one.)
ANSWER_INSTRUCTION = "Put your final answer inside <answer></answer> tags."

#: Seed offset of a held-out set from its training set. reasoning-gym seeds row ``i`` with ``seed + i``, so
#: seeds 0 and 1 give the same problems shifted by one row: sets need seeds further apart than their size.
HELD_OUT_SEED_OFFSET = 1_000_003
# The few-shot examples' seed: one fixed set of examples for every seed, so training and held-out prompts
# read the same examples (and no run seed comes near it).
_SHOT_SEED = 2_000_000_011
_INSTALL_HINT = "pip install 'trl-sae[gym]' (reasoning-gym)"


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(f"reasoning-gym tasks need reasoning-gym: {_INSTALL_HINT}.") from error
    return reasoning_gym


def parse_gym_name(name: str) -> str | None:
    """The task of a ``reasoning_gym:<task>`` dataset name; None for any other name."""
    if not name.startswith(GYM_PREFIX):
        return None
    task = name[len(GYM_PREFIX) :].strip()
    if not task:
        raise ValueError(f"dataset name {name!r} names no task: use e.g. reasoning_gym:chain_sum.")
    return task


def load_reasoning_gym(
    task: str,
    size: int,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    chat: bool = True,
    system_prompt: str | None = None,
    exclude_questions: Collection[str] = (),
    few_shot: int = 0,
    worked_steps: bool = False,
) -> Any:
    """``size`` problems of the reasoning-gym task ``task`` as a ``datasets.Dataset``.

    Args:
        task: a registered reasoning-gym dataset name (``chain_sum``, ``basic_arithmetic``, ...).
        size: number of rows (before ``exclude_questions`` removes any).
        seed: the generator's seed. A held-out set uses ``seed + HELD_OUT_SEED_OFFSET`` (row ``i`` is
            generated from ``seed + i``, so nearby seeds give the same rows) and excludes the training
            questions, since a small problem space repeats questions whatever the seed.
        config: the task's own settings (e.g. ``{"min_terms": 2, "max_terms": 3}`` for ``chain_sum``).
        chat: ``prompt`` as chat messages (``[{"role": "user", ...}]``) rather than plain text.
        system_prompt: a system message before the question (chat only).
        exclude_questions: questions to leave out, e.g. the training set's, so a held-out set with a
            small problem space shares no problem with it.
        few_shot: solved problems of the same task shown before each question (earlier chat turns, or
            question/answer pairs in plain text), answered in the stated format. A small model may never
            write the format unprompted (SmolLM2-135M-Instruct: 0 of 24 tagged answers zero-shot); the
            examples are the same for every seed and never appear as questions of the set.
        worked_steps: the few-shot examples of a chain of ``+`` and ``-`` (``chain_sum``,
            ``basic_arithmetic`` without ``*``, ``/`` or parentheses) work it out one operation a line, left
            to right (``32 - 15 = 17``, ``17 - 63 = -46``, ...), so the completions the model imitates take
            several steps instead of one line; other examples keep their one-line solution.

    Returns:
        Columns ``prompt``, ``question``, ``answer`` (the reference answer, as text) and
        :data:`ENTRY_COLUMN` (the entry as JSON).

    Raises:
        ValueError: an unknown task or a bad task setting (one line, naming the task).
    """
    from datasets import Dataset

    reasoning_gym = _reasoning_gym()
    if size < 1:
        raise ValueError(f"reasoning-gym task {task!r}: size must be at least 1, got {size}.")
    settings = {"seed": seed, "size": size, **dict(config or {})}
    _to_json(task, settings)  # a setting the rows cannot carry fails before any problem is generated
    try:
        generator = reasoning_gym.create_dataset(task, size=size, seed=seed, **dict(config or {}))
    except (ValueError, TypeError, AssertionError) as error:
        raise ValueError(f"reasoning-gym task {task!r}: {error}") from error
    if few_shot < 0:
        raise ValueError(f"reasoning-gym task {task!r}: few_shot must be >= 0, got {few_shot}.")
    if worked_steps and not few_shot:
        raise ValueError(
            f"reasoning-gym task {task!r}: worked_steps shapes the solved examples, but few_shot is 0; "
            "set few_shot (e.g. 2) or drop worked_steps."
        )
    shots = []
    if few_shot:
        solved = reasoning_gym.create_dataset(task, size=few_shot, seed=_SHOT_SEED, **dict(config or {}))
        shots = [(_user_content(e["question"]), _worked_answer(e, worked_steps)) for e in solved]
    excluded = set(exclude_questions) | {e["question"] for e in (solved if few_shot else ())}
    rows = []
    for entry in generator:
        if entry["question"] in excluded:
            continue
        content = _user_content(entry["question"])
        if chat:
            prompt: Any = [{"role": "system", "content": system_prompt}] if system_prompt else []
            for question, answer in shots:
                prompt += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            prompt.append({"role": "user", "content": content})
        else:
            prompt = "".join(f"{q}\n{a}\n\n" for q, a in shots) + content
        rows.append(
            {
                "prompt": prompt,
                "question": entry["question"],
                "answer": str(entry["answer"]),
                ENTRY_COLUMN: _to_json(task, {**entry, GENERATOR_KEY: settings}),
            }
        )
    if not rows:
        raise ValueError(f"reasoning-gym task {task!r}: every generated question was excluded.")
    return Dataset.from_list(rows)


def _user_content(question: str) -> str:
    return f"{question.rstrip()}\n\n{ANSWER_INSTRUCTION}"


def _worked_answer(entry: Mapping[str, Any], steps: bool = False) -> str:
    """An example's answer turn: the task's own solution expression when its metadata has one (the
    arithmetic tasks, countdown), then the tagged answer. Shown the bare tagged answer only, SmolLM2-135M
    guessed a number instead of computing it (2 of 24 right, against 11-17 of 24 untagged zero-shot).
    ``steps``: a chain of ``+``/``-`` as its left-to-right partial results (:func:`chain_steps`)."""
    answer = f"<answer>{entry['answer']}</answer>"
    expression = entry.get("metadata", {}).get("expression")
    if not isinstance(expression, str):
        return answer
    lines = chain_steps(expression) if steps else None
    return "\n".join([*(lines or [f"{expression} = {entry['answer']}"]), answer])


def chain_steps(expression: str) -> list[str] | None:
    """``"32 - 15 - 63"`` as ``["32 - 15 = 17", "17 - 63 = -46"]``: one operation a line, left to right;
    None when ``expression`` is not integers joined by ``+`` and ``-`` (left to right would be wrong)."""
    tokens = expression.split()
    numbers, operators = tokens[0::2], tokens[1::2]
    if len(tokens) < 3 or len(tokens) % 2 == 0 or set(operators) - {"+", "-"}:
        return None
    if not all(number.lstrip("-").isdigit() for number in numbers):
        return None
    total, lines = int(numbers[0]), []
    for operator, number in zip(operators, numbers[1:], strict=True):
        result = total + int(number) if operator == "+" else total - int(number)
        lines.append(f"{total} {operator} {number} = {result}")
        total = result
    return lines


def gym_entry(value: str | Mapping[str, Any]) -> dict[str, Any]:
    """A row's reasoning-gym entry from its :data:`ENTRY_COLUMN` value (JSON, or already a dict)."""
    return dict(value) if isinstance(value, Mapping) else json.loads(value, object_hook=_decode_setting)


def generator_settings(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``reasoning_gym.create_dataset`` that generated ``entry`` (from
    :func:`gym_entry`).

    Raises:
        ValueError: the entry carries no settings (its dataset was not built by this ``load_reasoning_gym``).
    """
    if GENERATOR_KEY not in entry:
        raise ValueError(
            f"reasoning-gym entry has no {GENERATOR_KEY!r} (the settings it was generated with, which its "
            "verifier reads): rebuild the dataset with trl_sae.gym.load_reasoning_gym."
        )
    return dict(entry[GENERATOR_KEY])


# JSON holds a task's settings; dates and times (time_intervals' bounds) travel as tagged ISO strings.
_TIME_TYPES = {t.__name__: t for t in (datetime.datetime, datetime.date, datetime.time)}
_TIME_TAG = "__isoformat__"


def _encode_setting(value: Any) -> Any:
    if type(value) in _TIME_TYPES.values():
        return {_TIME_TAG: type(value).__name__, "value": value.isoformat()}
    raise TypeError(f"{value!r} ({type(value).__name__})")


def _decode_setting(obj: dict[str, Any]) -> Any:
    if set(obj) == {_TIME_TAG, "value"}:
        return _TIME_TYPES[obj[_TIME_TAG]].fromisoformat(obj["value"])
    return obj


def _to_json(task: str, value: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(value), default=_encode_setting)
    except TypeError as error:
        raise ValueError(
            f"reasoning-gym task {task!r}: the setting {error} cannot be stored with the rows for the "
            "verifier; use JSON values, dates or times."
        ) from error
