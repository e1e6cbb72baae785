"""Code dataset loaders: each source layout, written here as a few rows, becomes prompt + tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from trl_sae.code_data import (
    CODE_DATASETS,
    code_tests_from_row,
    detect_code_layout,
    load_code_dataset,
    parse_code_tests,
)

APPS_ROWS = [
    {
        "problem_id": 0,
        "question": "Read two integers and print their sum.",
        "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)"]),
        "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}),
        "starter_code": "",
        "difficulty": "introductory",
    },
    {
        "problem_id": 1,
        "question": "Return the largest element.",
        "solutions": "[]",
        "input_output": json.dumps(
            {"fn_name": "biggest", "inputs": [[[1, 5, 2]], [[-1]]], "outputs": [[5], [-1]]}
        ),
        "starter_code": "def biggest(xs):\n    ",
        "difficulty": "interview",
    },
    {  # no tests at all: dropped with a warning
        "problem_id": 2,
        "question": "Broken row.",
        "solutions": "[]",
        "input_output": "",
        "starter_code": "",
        "difficulty": "interview",
    },
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_apps_layout_from_jsonl(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match=r"dropped 1 of 3 rows .* row 2, the tests cell is empty"):
        ds = load_code_dataset(_write_jsonl(tmp_path / "apps.jsonl", APPS_ROWS))
    assert ds.column_names == ["prompt", "tests"] and len(ds) == 2
    stdio, call = (parse_code_tests(t) for t in ds["tests"])
    assert (stdio.kind, stdio.inputs, stdio.outputs) == ("stdio", ("1 2\n", "5 5\n"), ("3\n", "10\n"))
    assert (call.kind, call.fn_name, call.inputs, call.outputs) == (
        "call",
        "biggest",
        ([[1, 5, 2]], [[-1]]),
        ([5], [-1]),
    )
    first, second = (p[0]["content"] for p in ds["prompt"])
    assert first.startswith("Read two integers") and "standard input" in first and "```python" in first
    assert "def biggest(xs):" in second and "Define the function `biggest`" in second


def test_bad_rows_can_be_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"row 2 of .* \(apps layout\): the tests cell is empty"):
        load_code_dataset(_write_jsonl(tmp_path / "apps.jsonl", APPS_ROWS), bad_rows="error")
    with pytest.raises(ValueError, match=r"no row .* has usable tests"), pytest.warns(RuntimeWarning):
        load_code_dataset(_write_jsonl(tmp_path / "bad.jsonl", APPS_ROWS[2:]))


def test_code_contests_layout_from_parquet(tmp_path: Path) -> None:
    rows = {
        "name": ["A. Double"],
        "description": ["Print twice the number."],
        "public_tests": [{"input": ["2\n"], "output": ["4\n"]}],
        "private_tests": [{"input": ["3\n", "0\n"], "output": ["6\n", "0\n"]}],
        "generated_tests": [{"input": [], "output": []}],
    }
    path = tmp_path / "cc.parquet"
    Dataset.from_dict(rows).to_parquet(str(path))
    ds = load_code_dataset(path, chat=False, max_tests=2)
    tests = parse_code_tests(ds[0]["tests"])
    assert (tests.inputs, tests.outputs) == (("2\n", "3\n"), ("4\n", "6\n"))
    assert ds[0]["prompt"].startswith("Print twice the number.")


def test_deepcoder_layouts() -> None:
    prime = {"problem": "p", "tests": json.dumps([{"type": "stdin_stdout", "input": "1\n", "output": "1\n"}])}
    assert json.loads(code_tests_from_row(prime, "deepcoder")) == {
        "kind": "stdio",
        "inputs": ["1\n"],
        "outputs": ["1\n"],
    }
    call = [{"type": "function_call", "fn_name": "f", "input": [1, 2], "output": [3]}]
    parsed = parse_code_tests(code_tests_from_row({"problem": "p", "tests": json.dumps(call)}, "deepcoder"))
    assert (parsed.kind, parsed.fn_name, parsed.inputs, parsed.outputs) == ("call", "f", ([1, 2],), ([3],))
    lcb = {
        "problem": "p",
        "tests": json.dumps([{"input": "[1, 2]\n3", "output": "4", "testtype": "functional"}]),
        "metadata": json.dumps({"func_name": "g"}),
    }
    parsed = parse_code_tests(code_tests_from_row(lcb, "deepcoder"))
    assert (parsed.fn_name, parsed.inputs, parsed.outputs) == ("g", ([[1, 2], 3],), (4,))
    taco = {"problem": "p", "tests": json.dumps({"inputs": ["x"], "outputs": ["y"]})}
    assert parse_code_tests(code_tests_from_row(taco, "deepcoder")).kind == "stdio"
    with pytest.raises(ValueError, match="mixed or unknown"):
        code_tests_from_row(
            {"problem": "p", "tests": json.dumps([{"input": "1", "output": "1", "type": "x"}])}, "deepcoder"
        )


def test_codeforces_humaneval_and_mbpp_layouts() -> None:
    cf = {"description": "d", "official_tests": [{"input": "1", "output": "2"}]}
    assert detect_code_layout(list(cf)) == "codeforces"
    assert parse_code_tests(code_tests_from_row(cf, "codeforces")).inputs == ("1",)
    he = {
        "prompt": "def f(x):\n",
        "test": "def check(candidate):\n    assert candidate(1) == 2\n",
        "entry_point": "f",
    }
    assert detect_code_layout(list(he)) == "humaneval"
    he_tests = parse_code_tests(code_tests_from_row(he, "humaneval"))
    assert he_tests.kind == "assert" and he_tests.asserts[0].endswith("check(f)")
    mbpp = {"text": "t", "test_list": ["assert f(1) == 2", "assert f(2) == 3"], "test_setup_code": ""}
    assert detect_code_layout(list(mbpp)) == "mbpp"
    mbpp_tests = parse_code_tests(code_tests_from_row(mbpp, "mbpp"))
    assert (mbpp_tests.kind, mbpp_tests.fn_name, mbpp_tests.outputs) == ("call", "f", (2, 3))


def test_unknown_layout_and_source_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="matches none of the layouts"):
        detect_code_layout(["question", "answer"])
    with pytest.raises(FileNotFoundError, match="neither a file"):
        load_code_dataset("./missing.jsonl")
    with pytest.raises(ValueError, match="`layout`"):
        load_code_dataset(_write_jsonl(tmp_path / "a.jsonl", APPS_ROWS[:1]), layout="leetcode")
    assert {"deepcoder", "apps", "taco", "code-contests", "codeforces"} <= set(CODE_DATASETS)


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="the code sandbox needs Linux and root"
)
def test_loaded_rows_score_with_the_reward(tmp_path: Path) -> None:
    from trl_sae.rewards import make_code_reward

    ds = load_code_dataset(_write_jsonl(tmp_path / "apps.jsonl", APPS_ROWS[:2]))
    solutions = [
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
        "```python\ndef biggest(xs):\n    return max(xs)\n```",
    ]
    reward = make_code_reward(cpu_seconds=1.0, wall_seconds=2.0, num_workers=2)
    assert reward(ds["prompt"], solutions, None, tests=ds["tests"]) == [1.0, 1.0]
    assert reward(ds["prompt"], solutions[::-1], None, tests=ds["tests"]) == [0.0, 0.0]


def test_registered_and_hub_datasets_load_through_the_shared_loader(monkeypatch) -> None:
    """trl_sae.data.load_rows loads them: the registry's config and split, the Hub id's own split."""
    calls = []

    def fake_load_dataset(path, name=None, split=None, cache_dir=None):
        calls.append((path, name, split))
        return Dataset.from_list(
            [{"problem": "p", "tests": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})}]
        )

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    monkeypatch.setattr("trl_sae.data._hub_unreachable_reason", lambda: None)
    assert load_code_dataset("deepcoder").column_names == ["prompt", "tests"]
    load_code_dataset("someone/their-set", split="test", layout="deepcoder")
    assert calls == [
        ("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", "train"),
        ("someone/their-set", None, "test"),
    ]


def test_an_unreachable_hub_says_how_to_download_for_load_code_dataset(monkeypatch) -> None:
    from trl_sae.data import DatasetUnavailableError

    def fake_load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'codeparrot/apps' on the Hub")

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    monkeypatch.setattr("trl_sae.data._hub_unreachable_reason", lambda: None)
    with pytest.raises(DatasetUnavailableError) as info:
        load_code_dataset("apps")
    assert "hf download codeparrot/apps --repo-type dataset --local-dir apps" in str(info.value)
    assert 'load_code_dataset("path/to/apps")' in str(info.value)


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_a_local_file_without_rows_is_refused_with_what_a_row_holds(tmp_path: Path, text: str) -> None:
    path = tmp_path / "none.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_code_dataset(path)
    assert str(info.value) == f"{str(path)!r} has no rows: put one problem per row with its tests."


def test_a_csv_file_loads_like_the_other_local_files(tmp_path: Path) -> None:
    path = tmp_path / "problems.csv"
    Dataset.from_list(
        [{"problem": "Print 1.", "tests": json.dumps({"inputs": ["\n"], "outputs": ["1\n"]})}]
    ).to_csv(path, index=False)
    dataset = load_code_dataset(path, layout="deepcoder")
    assert json.loads(dataset[0]["tests"]) == {"kind": "stdio", "inputs": ["\n"], "outputs": ["1\n"]}
