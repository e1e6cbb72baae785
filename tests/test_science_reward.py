"""science_accuracy and stem_accuracy: free-form answers with units, numbers within a tolerance, math-verify
for symbolic values, and each STEM row graded by its kind."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.rewards import REWARD_FUNCTIONS
from trl_sae.rewards.science import (
    final_answer,
    make_science_accuracy,
    science_accuracy,
    stem_accuracy,
)
from trl_sae.rewards.units import conversion_factor, parse_number, parse_unit, split_quantity

# Symbolic values go to math-verify in this thread (no worker pool in unit tests).
grade = make_science_accuracy(timeout_seconds=None)

CASES = [
    # (gold, completion, score)
    ("3.2 m s^-1", r"\boxed{3.2 m/s}", 1.0),  # the same unit written otherwise
    ("3.2 m s^-1", r"\boxed{3.2}", 1.0),  # a bare number is read in the gold's unit
    ("3.2", r"\boxed{3.2 m/s}", 1.0),  # gold without unit: the answer's unit is dropped
    ("3.2 m/s", r"\boxed{3.2 m}", 0.0),  # another dimension
    ("3.2 m/s", r"\boxed{3.2 kg}", 0.0),
    ("3.2 m", r"\boxed{320 cm}", 1.0),  # converted
    ("3.2 m", r"\boxed{32 cm}", 0.0),
    ("11.52 km/h", r"\boxed{3.2\ \mathrm{m\,s^{-1}}}", 1.0),
    ("1 atm", r"\boxed{760 mmHg}", 1.0),
    ("8.314 J/(mol K)", r"\boxed{8.314 J/mol K}", 1.0),  # juxtaposition binds tighter than /
    ("8.314 J/(mol K)", r"\boxed{8.314 J/mol*K}", 0.0),  # (J/mol) K: another dimension
    ("6.63e-34 J s", r"\boxed{6.626\times10^{-34}\ \mathrm{J\cdot s}}", 1.0),
    ("6.63e-34 J s", r"\boxed{1\times10^{-34} J s}", 0.0),  # math-verify alone says equal (rounding)
    ("2.0 eV", r"\boxed{3.204e-19 J}", 1.0),
    ("25 °C", r"\boxed{25^\circ C}", 1.0),
    ("25 °C", r"\boxed{298.15 K}", 0.0),  # temperature scales are not converted
    ("90°", r"\boxed{1.5708 rad}", 1.0),
    (r"\frac{16}{5} m/s", r"\boxed{3.2 m/s}", 1.0),  # symbolic gold, same unit: math-verify
    ("3.2 m/s", r"\boxed{\frac{16}{5}\,\mathrm{m/s}}", 1.0),
    ("3.2 m/s", r"\boxed{\frac{16}{5} km/s}", 0.0),  # converting a symbolic value is refused
    ("x^2+1", r"\boxed{1+x^2}", 1.0),
    (r"2\sqrt{3}", r"\boxed{\sqrt{12}}", 1.0),
    ("300 K", "The answer is 300 K.", 1.0),  # no box: the sentence after "answer is"
    ("300 K", "so it is about 300 K", 0.0),  # no final answer
    ("300 K", r"<think>\boxed{300 K}", 0.0),  # reasoning never closed
    ("2", r"\boxed{2.01}", 1.0),  # within 1%
    ("2", r"\boxed{2.03}", 0.0),
    ("0", r"\boxed{0}", 1.0),
    (r"\boxed{3.2 m/s}", r"\boxed{3.2}", 1.0),  # a gold answer stored boxed
]


@pytest.mark.parametrize(("gold", "completion", "score"), CASES)
def test_units_and_numbers(gold, completion, score):
    assert grade(None, [completion], None, answer=[gold]) == [score]


def test_missing_gold_is_none_and_a_missing_column_one_line():
    assert grade(None, [r"\boxed{1}", r"\boxed{1}"], None, answer=[None, "1"]) == [None, 1.0]
    with pytest.raises(ValueError, match=r"needs the gold answers in a dataset column named 'answer'"):
        grade(None, [r"\boxed{1}"], None, solution=["1"])
    with pytest.raises(ValueError, match=r"`rel_tol` must be a number in \[0, 1\), got 2"):
        make_science_accuracy(rel_tol=2)


@settings(max_examples=60, deadline=None)
@given(
    st.floats(1e-30, 1e30, allow_nan=False, allow_infinity=False),
    st.sampled_from([("m", "cm", 100.0), ("m", "km", 1e-3), ("J", "kJ", 1e-3), ("s", "ms", 1e3)]),
)
def test_a_value_converted_to_another_unit_of_its_dimension_is_correct(value, units):
    gold_unit, answer_unit, scale = units
    converted = value * scale
    completion = rf"\boxed{{{converted!r} {answer_unit}}}"
    assert grade(None, [completion], None, answer=[f"{value!r} {gold_unit}"]) == [1.0]
    # 5% off is wrong at the default 1% tolerance
    off = rf"\boxed{{{converted * 1.05!r} {answer_unit}}}"
    assert grade(None, [off], None, answer=[f"{value!r} {gold_unit}"]) == [0.0]


@settings(max_examples=60, deadline=None)
@given(st.floats(-1e6, 1e6).filter(lambda v: abs(v) > 1e-3), st.integers(-40, 40))
def test_scientific_notation_is_read_exactly(mantissa, exponent):
    digits = f"{mantissa:.4f}"
    expected = float(digits) * 10.0**exponent
    assert parse_number(f"{digits} \\times 10^{{{exponent}}}") == pytest.approx(expected, rel=1e-12)
    assert parse_number(f"{digits}e{exponent}") == pytest.approx(expected, rel=1e-12)
    assert parse_number(f"{digits}×10^{exponent}") == pytest.approx(expected, rel=1e-12)


def test_unit_parsing_and_dimensions():
    assert (
        parse_unit("m s^-1") == parse_unit("m/s") == parse_unit(r"\mathrm{m\,s^{-1}}") == parse_unit("m·s⁻¹")
    )
    assert parse_unit("km/h").factor == pytest.approx(1 / 3.6)
    assert parse_unit("kJ/mol").factor == 1000.0
    assert parse_unit("g/cm^3").factor == pytest.approx(1000.0)
    assert parse_unit("MeV").factor == pytest.approx(1.602176634e-13)
    assert conversion_factor(parse_unit("Å"), parse_unit("nm")) == pytest.approx(0.1)
    assert conversion_factor(parse_unit("m"), parse_unit("s")) is None
    assert conversion_factor(parse_unit("°C"), parse_unit("K")) is None
    for not_a_unit in ("apples", "x", "m^99", "m/", "(m", ""):
        assert parse_unit(not_a_unit) is None, not_a_unit
    quantity = split_quantity(r"1.5 \times 10^{3}\ \mathrm{J\,mol^{-1}}")
    assert (quantity.number, quantity.unit_text) == (1500.0, "J mol^{-1}")
    assert split_quantity("2x + 3").unit is None and split_quantity("2x + 3").number is None
    long = split_quantity("y " * 500 + "m/s")  # only a short tail is read as a unit
    assert (long.expression, long.unit_text) == ("y " * 499 + "y", "m/s")


def test_final_answer_reads_the_last_box_after_the_reasoning():
    assert final_answer(r"<think>\boxed{1}</think> so \boxed{2} or rather \boxed{3}") == "3"
    assert final_answer("**Answer:** 4 K. Done.") == "4 K"
    assert final_answer("no answer here") is None


def test_stem_accuracy_grades_each_row_by_its_kind():
    completions = [r"\boxed{B}", r"\boxed{320 cm}", "Answer: 1 m/s", r"\boxed{3.2 m}"]
    answers = ["B", "3.2 m", "A", "3.2 m/s"]
    choices = [["x", "y"], None, ["1 m/s", "3.2 m/s"], []]
    assert stem_accuracy(None, completions, None, answer=answers, choices=choices) == [1.0, 1.0, 1.0, 0.0]
    # Without a choices column every row is free-form.
    assert stem_accuracy(None, [r"\boxed{B}"], None, answer=["3.2"]) == [0.0]
    assert REWARD_FUNCTIONS["stem_accuracy"] is stem_accuracy
    assert REWARD_FUNCTIONS["science_accuracy"] is science_accuracy


def test_the_default_reward_verifies_symbolic_values_in_its_worker_pool():
    # The registered function uses math-verify's worker processes (per-item timeout) for symbolic values.
    scores = science_accuracy(
        None,
        [r"\boxed{\sqrt{12}}", r"\boxed{3}", r"\boxed{3.2 m/s}"],
        None,
        answer=[r"2\sqrt{3}", "e", "3.2"],
    )
    assert scores == [1.0, 0.0, 1.0]
    assert math.isclose(parse_number("1{,}000"), 1000.0)
