"""multiple_choice_accuracy: the chosen option by letter or text, the last answer statement, ambiguity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.rewards import REWARD_FUNCTIONS, compute_rewards
from trl_sae.rewards.multiple_choice import (
    LETTERS,
    extract_choice,
    make_multiple_choice_accuracy,
    multiple_choice_accuracy,
)

CHOICES = ["1 m/s", "3.2 m/s", "vitamin C", "Point A"]

TRICKY = [
    # (completion, expected letter or None)
    ("A good answer is C", "C"),  # "A" the article
    ("I think the answer is C", "C"),  # "I" the pronoun
    ("A good answer is C.", "C"),
    ("Answer: A good choice here is C", "C"),
    ("Answer: I believe it is C", "C"),
    ("Answer: A because the others violate energy conservation", "A"),
    ("Because of Avogadro's number, the answer is D.", "D"),  # A inside a word
    ("CABBAGE. The answer: B", "B"),  # letters inside a word are no option
    ("The answer is (A) or (C).", None),
    ("Answer: A and C", None),
    ("Answer: A, C", None),
    ("Answer: B) vitamin C", None),  # the letter B, the text of option C
    ("The answer is A. Wait, no. The answer is C.", "C"),
    ("Answer: A\n\nOn reflection \\boxed{C}", "C"),
    ("\\boxed{C} is tempting, but the answer is B.", "B"),
    ("Option D is correct.", "D"),
    ("(B) is the right answer", "B"),
    ("**Answer:** C", "C"),
    ("\\boxed{\\text{(D)}}", "D"),
    ("<answer>b</answer>", "B"),
    ("the correct option is Point A.", "D"),
    ("The answer is vitamin C, clearly.", "C"),
    ("The answer is C. A quick check confirms it.", "C"),
    ("Answer: E", None),  # four options: there is no E
    ("Let me think. Newton: F = ma", None),  # a letter in the reasoning is no answer
    ("<think>the answer is A</think> The answer is D", "D"),
    ("<think>the answer is A", None),  # reasoning never closed: no answer
    ("B", "B"),
    ("(b)", "B"),
    ("Final answer: b.", "B"),
    ("", None),
    ("The answer is clear once we compute it.", None),
]


# Markdown before a box must not move a later statement before it (positions were once taken after
# removing the emphasis for cues only): the later "answer is C" wins.
EMPHASIS_BEFORE_THE_BOX = (
    " ".join(f"**Step {k}**" for k in range(12)) + " so \\boxed{A}. Then the answer is C."
)
TRICKY.append((EMPHASIS_BEFORE_THE_BOX, "C"))


@pytest.mark.parametrize(("completion", "expected"), TRICKY)
def test_tricky_cases(completion, expected):
    assert extract_choice(completion, CHOICES) == expected


def test_letters_only_without_options_allow_a_to_j():
    assert extract_choice("Answer: J") == "J"
    assert extract_choice("Answer: K") is None
    assert extract_choice("Answer: 3.2 m/s") is None  # a text needs the options


def test_an_option_text_found_inside_another_is_not_a_second_option():
    choices = ["2", "2.5 mol", "7", "12"]
    assert extract_choice("So the answer is 2.5 mol.", choices) == "B"
    assert extract_choice("So the answer is 12.", choices) == "D"


# Option texts: words of lower-case letters and digits (not one letter a-j alone, which reads as a letter).
# A statement ends at ". ", so no word ends in a full stop.
_WORD = st.from_regex(r"[a-z0-9]{1,4}([./][a-z0-9]{1,3})?", fullmatch=True)
_TEXT = st.lists(_WORD, min_size=1, max_size=4).map(" ".join).filter(lambda t: t not in LETTERS.lower())


def _distinct(texts: list[str]) -> bool:
    # No option's text may occur, as whole words, inside another's (the answer would name both).
    padded = [f" {t} " for t in texts]
    return all(a == b or a not in b for a in padded for b in padded)


OPTIONS = st.lists(_TEXT, min_size=2, max_size=10, unique=True).filter(_distinct)

LETTER_FORMS = [
    "{L}",
    "({L})",
    "{L}.",
    "{L})",
    "Answer: {L}",
    "answer: {l}",
    "The answer is **{L}**.",
    "the answer is {L}",
    "\\boxed{{{L}}}",
    "\\boxed{{({L})}}",
    "Final answer: ({l})",
    "So the correct option is {L}!",
    "<answer>{L}</answer>",
    "{L} is correct.",
    "The answer is ({L}) {text}",
    "Answer: {L}) {text}",
]
TEXT_FORMS = [
    "{text}",
    "{TEXT}",
    "{text}.",
    "The answer is {text}.",
    "answer: {TEXT}!",
    "\\boxed{{{text}}}",
    "The final answer is **{text}**",
]


@settings(max_examples=150, deadline=None)
@given(
    OPTIONS, st.data(), st.sampled_from(LETTER_FORMS + TEXT_FORMS), st.sampled_from(["", "x\n", "We see.\n"])
)
def test_any_format_of_the_gold_option_is_read(choices, data, form, reasoning):
    k = data.draw(st.integers(0, len(choices) - 1))
    letter, text = LETTERS[k], choices[k]
    completion = reasoning + form.format(L=letter, l=letter.lower(), text=text, TEXT=text.upper())
    assert extract_choice(completion, choices) == letter
    scores = multiple_choice_accuracy(None, [completion], None, answer=[letter], choices=[choices])
    assert scores == [1.0]
    other = LETTERS[(k + 1) % len(choices)]
    assert multiple_choice_accuracy(None, [completion], None, answer=[other], choices=[choices]) == [0.0]


@settings(max_examples=100, deadline=None)
@given(OPTIONS, st.data(), st.sampled_from(["Answer: {a}", "\\boxed{{{a}}}", "The answer is ({a})."]))
def test_the_last_stated_answer_wins(choices, data, form):
    first, last = (data.draw(st.integers(0, len(choices) - 1)) for _ in range(2))
    completion = f"The answer is {LETTERS[first]}.\nHmm, let me re-check.\n" + form.format(a=LETTERS[last])
    assert extract_choice(completion, choices) == LETTERS[last]


@settings(max_examples=100, deadline=None)
@given(OPTIONS, st.data(), st.sampled_from(["{a} or {b}", "({a}) and ({b})", "{a}, {b}", "{a}/{b}"]))
def test_two_different_options_in_the_final_statement_score_nothing(choices, data, joined):
    a, b = data.draw(st.lists(st.integers(0, len(choices) - 1), min_size=2, max_size=2, unique=True))
    completion = "Answer: " + joined.format(a=LETTERS[a], b=LETTERS[b])
    assert extract_choice(completion, choices) is None
    assert multiple_choice_accuracy(None, [completion], None, answer=[LETTERS[a]], choices=[choices]) == [0.0]


def test_the_reward_in_a_batch_with_weights_and_missing_golds():
    total, per_function = compute_rewards(
        ["multiple_choice_accuracy"],
        [2.0],
        prompts=["q1", "q2", "q3"],
        completions=["\\boxed{B}", "Answer: 3.2 m/s", "\\boxed{B}"],
        completion_ids=[[1], [2], [3]],
        columns={"answer": ["B", "B", None], "choices": [CHOICES, CHOICES, CHOICES]},
    )
    assert per_function["multiple_choice_accuracy"].tolist() == [1.0, 1.0, 0.0]
    assert total.tolist() == [2.0, 2.0, 0.0]
    assert REWARD_FUNCTIONS["multiple_choice_accuracy"] is multiple_choice_accuracy


def test_bad_gold_letters_and_missing_columns_are_one_line_errors():
    with pytest.raises(ValueError, match=r"row 1 of column 'answer' is '3\.2', not an option letter A-J"):
        multiple_choice_accuracy(None, ["A", "B"], None, answer=["A", "3.2"])
    with pytest.raises(ValueError, match=r"needs the gold letters in a dataset column named 'gold'"):
        make_multiple_choice_accuracy(answer_column="gold")(None, ["A"], None, answer=["A"])


def test_letters_only_when_the_batch_has_no_options():
    grade = make_multiple_choice_accuracy(choices_column=None, name="mc")
    assert grade.__name__ == "mc"
    assert grade(None, ["\\boxed{C}", "3.2 m/s"], None, answer=["C", "B"], choices=[CHOICES, CHOICES]) == [
        1.0,
        0.0,  # the option's text does not count without options
    ]
