"""rewards/base.py: the column every reward reads and the rows it grades, written once for the built-ins."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.rewards import REWARD_FUNCTIONS
from trl_sae.rewards.base import graded_rows, required_column

# Each built-in's message for a missing column, as it was before the column check was shared.
MISSING_COLUMN = {
    "math_accuracy": "math_accuracy needs the gold answers in a dataset column named 'answer'; the batch has "
    "columns ['gold']. Rename the column or use make_math_accuracy(answer_column=...).",
    "science_accuracy": "science_accuracy needs the gold answers in a dataset column named 'answer'; the "
    "batch has columns ['gold']. Use make_science_accuracy(answer_column=...).",
    "multiple_choice_accuracy": "multiple_choice_accuracy needs the gold letters in a dataset column named "
    "'answer'; the batch has columns ['gold']. Use make_multiple_choice_accuracy(answer_column=...).",
    "code_tests": "code_tests needs the tests in a dataset column named 'tests'; the batch has columns "
    "['gold']. Load the data with trl_sae.code_data.load_code_dataset or use "
    "make_code_reward(tests_column=...).",
}


@pytest.mark.parametrize("name", sorted(MISSING_COLUMN))
def test_each_reward_names_its_missing_column_and_the_fix(name):
    with pytest.raises(ValueError) as error:
        REWARD_FUNCTIONS[name](None, ["x"], None, gold=["1"])
    assert str(error.value) == MISSING_COLUMN[name]


@pytest.mark.parametrize(
    ("name", "column"),
    [
        ("math_accuracy", "answer"),
        ("science_accuracy", "answer"),
        ("multiple_choice_accuracy", "answer"),
        ("code_tests", "tests"),
    ],
)
def test_each_reward_refuses_a_column_of_another_length(name, column):
    with pytest.raises(ValueError) as error:
        REWARD_FUNCTIONS[name](None, ["x"], None, **{column: [None, None]})
    assert str(error.value) == f"{name}: column {column!r} has 2 values for 1 completions."


def test_a_column_of_none_is_missing_and_not_listed():
    """math_accuracy(..., answer=None) and code_tests(..., tests=None) pass their own column on as None: the
    message listed it among the batch's columns."""
    with pytest.raises(ValueError) as error:
        required_column({"answer": None, "gold": [1]}, "answer", reward="r", holds="golds", fix="Fix it.")
    assert (
        str(error.value)
        == "r needs golds in a dataset column named 'answer'; the batch has columns ['gold']. Fix it."
    )


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(-5, 5)), max_size=12))
def test_graded_rows_are_the_rows_with_a_gold_in_order(golds):
    completions = [f"c{i}" for i in range(len(golds))]
    rows = list(graded_rows(completions, golds, lambda value, i: None if value is None else (value, i)))
    assert rows == [(i, f"c{i}", (g, i)) for i, g in enumerate(golds) if g is not None]


def test_graded_rows_read_only_the_completions_they_grade():
    """A row without a gold is scored None and its completion is not read (here one no reader could read)."""
    completions = [object(), [{"role": "assistant", "content": "B"}]]
    assert list(graded_rows(completions, [None, "g"], lambda value, i: value)) == [(1, "B", "g")]
    with pytest.raises(ValueError, match="expected text or a list of chat messages"):
        list(graded_rows(completions, ["g", "g"], lambda value, i: value))
