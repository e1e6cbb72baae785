"""A generated offline code task: short Python functions over integers and strings, with tests.

Each problem asks for one function (``def solve(...)``), states what it returns and shows one example;
its tests are function calls on random arguments whose expected values come from a reference
implementation, in the format :func:`trl_sae.rewards.code_tests` runs (``{"kind": "call", ...}``). The
reference solution is kept in ``solution`` (a fenced block, as a completion would have it) for warm starts
and for checking the task itself. Nothing is downloaded: the task is for trying the code reward and the
sandbox offline, not a benchmark of code ability.

Families (each with random constants, so that prompts differ):

* ``affine``: ``a * x + b``; ``digit_sum``: the sum of the decimal digits of ``|x|``;
* ``count_char``: occurrences of a character in a string; ``reverse_words``: the words in reverse order;
* ``max_gap``: the largest difference between neighbours of a list; ``mod_sum``: the sum of the
  elements divisible by ``k``; ``caesar``: letters shifted by ``k`` places.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CODE_TASK_FAMILIES", "make_code_task_dataset"]


@dataclass(frozen=True)
class _Family:
    describe: Callable[[dict[str, Any]], str]  # what solve returns, given the family's constants
    signature: str
    source: Callable[[dict[str, Any]], str]  # a reference body (one function)
    constants: Callable[[random.Random], dict[str, Any]]
    arguments: Callable[[random.Random], list[Any]]


def _word(rng: random.Random, letters: str = "abcde") -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(1, 6)))


CODE_TASK_FAMILIES: dict[str, _Family] = {
    "affine": _Family(
        lambda c: f"{c['a']} * x + {c['b']}",
        "solve(x: int) -> int",
        lambda c: f"def solve(x):\n    return {c['a']} * x + {c['b']}\n",
        lambda rng: {"a": rng.randint(-9, 9), "b": rng.randint(-20, 20)},
        lambda rng: [rng.randint(-1000, 1000)],
    ),
    "digit_sum": _Family(
        lambda c: "the sum of the decimal digits of abs(x)",
        "solve(x: int) -> int",
        lambda c: "def solve(x):\n    return sum(int(d) for d in str(abs(x)))\n",
        lambda rng: {},
        lambda rng: [rng.randint(-(10**9), 10**9)],
    ),
    "count_char": _Family(
        lambda c: f"how many times the character {c['ch']!r} occurs in s",
        "solve(s: str) -> int",
        lambda c: f"def solve(s):\n    return s.count({c['ch']!r})\n",
        lambda rng: {"ch": rng.choice("abcde")},
        lambda rng: [_word(rng) + _word(rng) + _word(rng)],
    ),
    "reverse_words": _Family(
        lambda c: "the words of s (separated by single spaces) in reverse order, joined by single spaces",
        "solve(s: str) -> str",
        lambda c: "def solve(s):\n    return ' '.join(reversed(s.split(' ')))\n",
        lambda rng: {},
        lambda rng: [" ".join(_word(rng) for _ in range(rng.randint(1, 5)))],
    ),
    "max_gap": _Family(
        lambda c: (
            "the largest absolute difference between neighbouring elements of xs (0 if it has one element)"
        ),
        "solve(xs: list[int]) -> int",
        lambda c: "def solve(xs):\n    return max((abs(a - b) for a, b in zip(xs, xs[1:])), default=0)\n",
        lambda rng: {},
        lambda rng: [[rng.randint(-50, 50) for _ in range(rng.randint(1, 8))]],
    ),
    "mod_sum": _Family(
        lambda c: f"the sum of the elements of xs that are divisible by {c['k']}",
        "solve(xs: list[int]) -> int",
        lambda c: f"def solve(xs):\n    return sum(x for x in xs if x % {c['k']} == 0)\n",
        lambda rng: {"k": rng.randint(2, 5)},
        lambda rng: [[rng.randint(-30, 30) for _ in range(rng.randint(0, 8))]],
    ),
    "caesar": _Family(
        lambda c: (
            f"s with every lowercase letter shifted {c['k']} places forward in the alphabet (z wraps to a)"
        ),
        "solve(s: str) -> str",
        lambda c: (
            "def solve(s):\n    return ''.join(chr((ord(ch) - 97 + "
            f"{c['k']}) % 26 + 97) if ch.islower() else ch for ch in s)\n"
        ),
        lambda rng: {"k": rng.randint(1, 25)},
        lambda rng: [_word(rng, string.ascii_lowercase + " ")],
    ),
}


def _reference(source: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # our own reference code, never a model's
    return namespace["solve"]


def make_code_task_dataset(
    size: int,
    *,
    seed: int = 0,
    num_tests: int = 5,
    families: list[str] | None = None,
    chat: bool = True,
):
    """``size`` generated problems as a :class:`datasets.Dataset` (``prompt``, ``tests``, ``solution``, ``family``).

    Args:
        size: number of problems.
        seed: the random seed (the same seed gives the same problems).
        num_tests: tests per problem (random arguments; the prompt shows the first as an example).
        families: which of :data:`CODE_TASK_FAMILIES` to draw from (all by default), round robin.
        chat: ``prompt`` as chat messages (True) or text.

    Example:
        >>> ds = make_code_task_dataset(4, seed=1)
        >>> sorted(ds.column_names)
        ['family', 'prompt', 'solution', 'tests']
    """
    from datasets import Dataset

    from trl_sae.code_data import DEFAULT_CODE_INSTRUCTION

    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"`size` must be a positive integer, got {size!r}.")
    if not isinstance(num_tests, int) or isinstance(num_tests, bool) or num_tests < 1:
        raise ValueError(f"`num_tests` must be a positive integer, got {num_tests!r}.")
    names = list(CODE_TASK_FAMILIES) if families is None else list(families)
    unknown = [n for n in names if n not in CODE_TASK_FAMILIES]
    if unknown or not names:
        raise ValueError(f"`families` has unknown names {unknown}; choose from {sorted(CODE_TASK_FAMILIES)}.")
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "tests": [], "solution": [], "family": []}
    for i in range(size):
        name = names[i % len(names)]
        family = CODE_TASK_FAMILIES[name]
        constants = family.constants(rng)
        source = family.source(constants)
        solve = _reference(source)
        inputs = [family.arguments(rng) for _ in range(num_tests)]
        outputs = [solve(*args) for args in inputs]
        example = f"solve({', '.join(map(repr, inputs[0]))}) == {outputs[0]!r}"
        text = (
            f"Write a Python function `{family.signature}` that returns {family.describe(constants)}.\n"
            f"Example: `{example}`.\n\n{DEFAULT_CODE_INSTRUCTION}"
        )
        rows["prompt"].append([{"role": "user", "content": text}] if chat else text)
        rows["tests"].append(
            json.dumps({"kind": "call", "fn_name": "solve", "inputs": inputs, "outputs": outputs})
        )
        rows["solution"].append(f"```python\n{source}```")
        rows["family"].append(name)
    return Dataset.from_dict(rows)
