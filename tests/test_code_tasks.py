"""The generated code task: deterministic problems whose reference solutions pass their own tests."""

from __future__ import annotations

import os
import sys

import pytest

from trl_sae.code_data import parse_code_tests
from trl_sae.demo import CODE_TASK_FAMILIES, make_code_task_dataset


def test_same_seed_same_problems_and_every_family() -> None:
    first = make_code_task_dataset(14, seed=3)
    assert first.to_dict() == make_code_task_dataset(14, seed=3).to_dict()
    assert first["tests"] != make_code_task_dataset(14, seed=4)["tests"]
    assert sorted(set(first["family"])) == sorted(CODE_TASK_FAMILIES)
    for cell in first["tests"]:
        tests = parse_code_tests(cell)
        assert (tests.kind, tests.fn_name, len(tests)) == ("call", "solve", 5)
    example = first[0]["prompt"][0]["content"]
    assert "def solve" not in example and "Example: `solve(" in example and "```python" in example


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="`size`"):
        make_code_task_dataset(0)
    with pytest.raises(ValueError, match="unknown names \\['sorting'\\]"):
        make_code_task_dataset(2, families=["affine", "sorting"])


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="the code sandbox needs Linux and root"
)
def test_reference_solutions_pass_and_swapped_ones_fail() -> None:
    from trl_sae.rewards import make_code_reward

    ds = make_code_task_dataset(len(CODE_TASK_FAMILIES), seed=0, num_tests=4)
    reward = make_code_reward(cpu_seconds=1.0, wall_seconds=2.0, num_workers=2)
    assert reward(ds["prompt"], ds["solution"], None, tests=ds["tests"]) == [1.0] * len(ds)
    shifted = ds["solution"][1:] + ds["solution"][:1]  # each problem gets another family's solution
    assert reward(ds["prompt"], shifted, None, tests=ds["tests"]) == [0.0] * len(ds)
