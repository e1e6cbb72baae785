"""The code reward: extracting the program, reading the tests, comparing outputs, scoring, deadlines."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.code_data import CodeTests, parse_code_tests
from trl_sae.rewards import REWARD_FUNCTIONS, make_code_reward
from trl_sae.rewards._sandbox_launcher import normalize_output
from trl_sae.rewards.code import extract_code
from trl_sae.rewards.protocol import compute_rewards, validate_reward_funcs
from trl_sae.rewards.sandbox import Sandbox, SandboxLimits, find_sandbox_processes

needs_sandbox = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="the code sandbox needs Linux and root"
)

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
STDIO = json.dumps({"inputs": ["1 2\n", "10 -3\n", "0 0"], "outputs": ["3\n", "7", "0\n"]})


def _fence(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\n"


# ---------------------------------------------------------------------------------------------------
# Extraction and parsing (no sandbox).
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "code", "reason"),
    [
        ("```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```", "print(2)\n", None),
        ("```\nprint(3)\n```", "print(3)\n", None),
        ("```python\nprint(1)\n```\n```text\n3\n```", "print(1)\n", None),  # sample output after the code
        ("```cpp\nint main(){}\n```", None, "no Python code block (last one is 'cpp')"),
        ("I think the answer is 3.", None, "no code block"),
        ("```python\nprint(1)\n", None, "no code block"),  # truncated: no closing fence
        ("```python\n\n```", None, "empty code block"),
    ],
)
def test_extract_code(text: str, code: str | None, reason: str | None) -> None:
    assert extract_code(text) == (code, reason)


def test_parse_layouts() -> None:
    stdio = parse_code_tests(STDIO)
    assert (stdio.kind, len(stdio)) == ("stdio", 3)
    call = parse_code_tests({"fn_name": "add", "inputs": [[1, 2], 5], "outputs": [3, [5]]})
    assert call == CodeTests(kind="call", inputs=([1, 2], [5]), outputs=(3, [5]), fn_name="add")
    converted = parse_code_tests({"asserts": ["assert add(1, 2) == 3", "assert 7 == add(3, 4)"]})
    assert converted == CodeTests(kind="call", inputs=([1, 2], [3, 4]), outputs=(3, 7), fn_name="add")
    kept = parse_code_tests({"asserts": ["assert abs(area(1) - 3.14159) < 1e-3"]})
    assert kept.kind == "assert" and kept.asserts == ("assert abs(area(1) - 3.14159) < 1e-3",)
    assert parse_code_tests(stdio.to_json()) == stdio and parse_code_tests(call.to_json()) == call


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (None, "no tests"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
        ({"inputs": [], "outputs": []}, "no tests"),
        ({"inputs": [1], "outputs": ["1"]}, "inputs must be text"),
        ({"fn_name": "not a name", "inputs": [[1]], "outputs": [1]}, "fn_name"),
        ({"asserts": []}, "non-empty list"),
        ({"kind": "junit", "inputs": [], "outputs": []}, "unknown test kind"),
    ],
)
def test_malformed_tests_say_why(cell, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_code_tests(cell)


_line = st.text(alphabet="ab1 \t", max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(_line, min_size=1, max_size=5), st.lists(st.sampled_from([" ", "\t", "\r"]), max_size=3))
def test_output_comparison_ignores_spacing_but_not_words(lines: list[str], pad: list[str]) -> None:
    text = "\n".join(lines)
    padded = (
        "\n\n" + "\n".join(line.replace(" ", " " + "".join(pad)) + "".join(pad) for line in lines) + "\n\n"
    )
    assert normalize_output(padded) == normalize_output(text)
    words = text.split()
    if words:
        changed = text.replace(words[0], words[0] + "x", 1)
        assert normalize_output(changed) != normalize_output(text)


def test_blank_lines_inside_the_output_count() -> None:
    assert normalize_output("1\n\n2") != normalize_output("1\n2")
    assert normalize_output("1 2\r\n3\t\n\n") == normalize_output("1  2\n3")


def test_registered_by_name() -> None:
    funcs, names, _ = validate_reward_funcs(["code_tests"])
    assert names == ["code_tests"] and funcs[0] is REWARD_FUNCTIONS["code_tests"]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="scoring"):
        make_code_reward(scoring="partial")
    with pytest.raises(ValueError, match="batch_seconds"):
        make_code_reward(batch_seconds=0)
    with pytest.raises(ValueError, match="not both"):
        make_code_reward(cpu_seconds=1.0, sandbox=Sandbox())
    with pytest.raises(ValueError, match="cpu_seconds"):
        SandboxLimits(cpu_seconds=-1)


# ---------------------------------------------------------------------------------------------------
# Scoring in the sandbox.
# ---------------------------------------------------------------------------------------------------
FAST = Sandbox(limits=SandboxLimits(cpu_seconds=1, wall_seconds=2, completion_seconds=6, memory_mb=256))


def _reward(**kwargs):
    kwargs.setdefault("num_workers", 2)
    return make_code_reward(sandbox=FAST, **kwargs)


@needs_sandbox
def test_stdio_scores_all_or_nothing_and_fraction() -> None:
    wrong_on_one = _fence("a, b = map(int, input().split())\nprint(a + b if a else 1)")
    completions = [ADD, wrong_on_one, "no code", _fence("print(")]
    strict, fraction = _reward(), _reward(scoring="fraction")
    assert strict(None, completions, None, tests=[STDIO] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert fraction(None, completions, None, tests=[STDIO] * 4) == [1.0, pytest.approx(2 / 3), 0.0, 0.0]
    reasons = [v.reason for v in fraction.last_verdicts]
    assert reasons[0] == "passed" and reasons[1] == "test 2: wrong_answer"
    assert reasons[2] == "no code block" and reasons[3].startswith("syntax error: SyntaxError")
    # All or nothing stops a program at its first failed test (the third test never ran).
    assert strict.last_verdicts[1].statuses == ["ok", "ok", "wrong_answer"]
    stops_early = _fence("a, b = map(int, input().split())\nprint(0)")
    strict(None, [stops_early], None, tests=[STDIO])
    assert strict.last_verdicts[0].statuses == ["wrong_answer", "not_run", "not_run"]


@needs_sandbox
def test_call_and_assert_tests() -> None:
    call = json.dumps({"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], 4]})
    asserts = json.dumps({"asserts": ["assert abs(add(0.1, 0.2) - 0.3) < 1e-9", "assert add(2, 2) == 4"]})
    good = _fence("def add(a, b):\n    return a + b")
    leetcode = _fence("class Solution:\n    def add(self, a, b):\n        return a + b")
    forged = _fence("import os\nos.write(3, b'99')\nos._exit(0)")  # fakes a result without computing it
    reward = _reward(scoring="fraction")
    scores = reward(None, [good, leetcode, forged, good], None, tests=[call, call, call, asserts])
    assert scores == [1.0, 1.0, pytest.approx(0.0), 1.0]


@needs_sandbox
def test_bad_rows_score_zero_with_a_reason_and_one_warning() -> None:
    reward = _reward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = reward(None, [ADD, ADD, ADD], None, tests=[None, '{"inputs": [1]}', STDIO])
    assert scores == [0.0, 0.0, 1.0]
    assert reward.last_verdicts[0].reason == "bad tests: the row has no tests"
    assert reward.last_verdicts[1].reason.startswith("bad tests: the tests need lists")
    assert sum("unusable" in str(w.message) for w in caught) == 1


@needs_sandbox
def test_missing_column_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="column named 'tests'"):
        _reward()(None, [ADD], None, answer=["3"])


@needs_sandbox
def test_batch_deadline_cuts_the_batch_and_says_so() -> None:
    loop = _fence("while True:\n    pass")
    tests = json.dumps({"inputs": [""] * 3, "outputs": ["1"] * 3})
    reward = _reward(num_workers=2, batch_seconds=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = reward(None, [loop] * 6, None, tests=[tests] * 6)
    assert scores == [0.0] * 6
    # Two programs were running at the deadline, the other four never started: all six are counted.
    assert reward.last_stats["cut_by_deadline"] == 6
    assert {v.reason for v in reward.last_verdicts} == {"batch deadline"}
    assert reward.last_stats["leaked"] == 0
    assert find_sandbox_processes([FAST.uid(0), FAST.uid(1)]) == []


@needs_sandbox
def test_through_compute_rewards_with_conversational_completions() -> None:
    total, _ = compute_rewards(
        [_reward()],
        None,
        prompts=["p", "p"],
        completions=[[{"role": "assistant", "content": ADD}], [{"role": "assistant", "content": "?"}]],
        completion_ids=[[1], [2]],
        columns={"tests": [STDIO, STDIO]},
    )
    assert total.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("num_workers", [0, 257, True, 2.5])
def test_a_worker_count_the_sandbox_cannot_hold_is_refused_when_the_reward_is_made(num_workers):
    """More sandboxes at once than a process has uids for failed mid-training, at the 257th; now at once."""
    from trl_sae.rewards.code import make_code_reward

    with pytest.raises(ValueError, match=r"`num_workers` must be an integer in \[1, 256\]"):
        make_code_reward(num_workers=num_workers)
