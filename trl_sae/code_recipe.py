"""Code datasets by name, for recipes (``trl-sae train``) and ``trl-sae eval``.

Two forms of name:

* ``code_task``: the generated offline task (:func:`trl_sae.demo.make_code_task_dataset`); its settings come
  from a JSON object (``code_task_config``: ``families``, ``num_tests``, ``few_shot``);
* ``code:<source>``: a code dataset through :func:`trl_sae.code_data.load_code_dataset` (a registry name such
  as ``apps``, an ``owner/name`` Hub id, or a local ``.json``/``.jsonl``/``.parquet`` file or folder).

Both give ``prompt`` + ``tests`` (+ ``question``, the problem's text, which keeps held-out sets free of
training problems) and are graded by the ``code_tests`` reward.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "CODE_PREFIX",
    "CODE_REWARD",
    "CODE_TASK_NAME",
    "load_code_source",
    "load_code_task",
    "parse_code_name",
    "parse_code_task_config",
]

CODE_PREFIX = "code:"
CODE_TASK_NAME = "code_task"
CODE_REWARD = "code_tests"
_CONFIG_KEYS = ("families", "num_tests", "few_shot")
# Solved examples come from their own seed, far from any run's seed, so they are the same problems for the
# training and the held-out set (the format a model sees does not change between them).
_SHOT_SEED = 7_000_003


def parse_code_name(name: str | None) -> tuple[str, str | None] | None:
    """``("task", None)`` for ``code_task``, ``("source", src)`` for ``code:<src>``, else None."""
    if not name:
        return None
    if name == CODE_TASK_NAME:
        return "task", None
    if name.startswith(CODE_PREFIX):
        source = name[len(CODE_PREFIX) :].strip()
        if not source:
            raise ValueError(
                f"dataset {name!r}: name the source after 'code:', e.g. code:data/problems.jsonl."
            )
        return "source", source
    return None


def parse_code_task_config(text: str | None) -> dict[str, Any]:
    """The ``code_task_config`` JSON object as keyword arguments, each key checked (an unknown key fails)."""
    if not text:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"code_task_config: not a JSON object ({error}).") from error
    if not isinstance(config, dict):
        raise ValueError('code_task_config: must be a JSON object, e.g. \'{"families": ["affine"]}\'.')
    unknown = sorted(set(config) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"code_task_config: unknown keys {unknown}; known: {list(_CONFIG_KEYS)}.")
    from trl_sae.code_tasks import CODE_TASK_FAMILIES

    families = config.get("families")
    if families is not None and (
        not isinstance(families, list) or not families or any(f not in CODE_TASK_FAMILIES for f in families)
    ):
        raise ValueError(
            f"code_task_config: families must be a non-empty list of {sorted(CODE_TASK_FAMILIES)}, got {families!r}."
        )
    for key, least in (("num_tests", 1), ("few_shot", 0)):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ValueError(f"code_task_config: {key} must be an integer >= {least}, got {value!r}.")
    return config


def _with_system(prompt: Any, system_prompt: str | None, chat: bool) -> Any:
    if not system_prompt:
        return prompt
    return [{"role": "system", "content": system_prompt}, *prompt] if chat else f"{system_prompt}\n\n{prompt}"


def _question(prompt: Any) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def load_code_task(
    size: int,
    seed: int,
    config: dict[str, Any] | None = None,
    *,
    chat: bool = True,
    system_prompt: str | None = None,
    exclude_questions: Any = (),
) -> Any:
    """``size`` generated problems (fewer once those in ``exclude_questions`` are dropped), with
    ``config['few_shot']`` solved problems (from their own seed, never among the rows) as earlier turns."""
    from trl_sae.code_tasks import make_code_task_dataset

    config = dict(config or {})
    few_shot = config.pop("few_shot", 0)
    dataset = make_code_task_dataset(size, seed=seed, chat=False, **config)
    shots = make_code_task_dataset(few_shot, seed=_SHOT_SEED, chat=False, **config) if few_shot else None
    excluded = set(exclude_questions) | set(shots["prompt"] if shots else ())
    rows = []
    for row in dataset:
        question = row["prompt"]
        if question in excluded:
            continue
        excluded.add(question)  # a repeated problem is kept once
        if chat:
            prompt: Any = []
            for shot in shots or ():
                prompt += [
                    {"role": "user", "content": shot["prompt"]},
                    {"role": "assistant", "content": shot["solution"]},
                ]
            prompt.append({"role": "user", "content": question})
        else:
            prompt = "".join(f"{s['prompt']}\n{s['solution']}\n\n" for s in shots or ()) + question
        rows.append({**row, "prompt": _with_system(prompt, system_prompt, chat), "question": question})
    if not rows:
        raise ValueError("code_task: every generated problem was excluded (raise max_eval_samples).")
    from datasets import Dataset

    return Dataset.from_list(rows)


def load_code_source(
    source: str,
    split: str | None = None,
    *,
    chat: bool = True,
    system_prompt: str | None = None,
    exclude_questions: Any = (),
) -> Any:
    """A code dataset (:func:`trl_sae.code_data.load_code_dataset`) with a ``question`` column, its rows whose
    problem is in ``exclude_questions`` dropped."""
    from trl_sae.code_data import load_code_dataset

    dataset = load_code_dataset(source, split=split, chat=chat)
    excluded = set(exclude_questions)
    dataset = dataset.map(
        lambda row: {
            "question": _question(row["prompt"]),
            "prompt": _with_system(row["prompt"], system_prompt, chat),
        }
    )
    if excluded:
        dataset = dataset.filter(lambda row: row["question"] not in excluded)
        if len(dataset) == 0:
            raise ValueError(f"code:{source}: every problem is also a training problem.")
    return dataset
