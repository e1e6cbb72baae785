"""Multiple-choice accuracy (GPQA-style): the option a completion chooses, by letter or by the option's text.

:func:`extract_choice` reads the chosen option from a completion; :func:`multiple_choice_accuracy` scores it
against the gold letter. The rules, in order:

1. Only the part after the reasoning counts (after the last ``</think>``; a completion that opens
   ``<think>`` and never closes it has no answer).
2. *Answer statements* are collected: each ``\\boxed{...}``, each ``<answer>...</answer>``, the rest of the
   sentence after a cue (``answer is``, ``answer:``, ``correct option is``, ``the best choice would be``
   ...) and ``X is correct`` / ``(X) is the right answer``. Markdown emphasis and ``\\text{}``-style LaTeX
   wrappers are ignored. The **last** statement that names an option wins; one naming two different
   options (``A or C``, ``(A) and (C)``, a letter whose text is another option's) is ambiguous and the
   completion has no answer.
3. A statement names an option when it is, after trimming brackets, whitespace and trailing punctuation:
   a letter (``B``, ``(B)``, ``B.``, ``B)``, ``b``); an option's text (case-insensitive, whitespace
   collapsed); or starts with a letter (``(B) 3.2 m/s``; a bare ``A`` or ``I`` before a lower-case word
   is the article or the pronoun when the rest names an option, "A good choice is C", and the answer
   otherwise, "A because ..."). Otherwise it is searched for capital letters standing alone (not inside
   a word, not such an article or pronoun) and for option texts; exactly one option found names it.
4. Without any statement, a last line that is only an option (``(B)``, ``B.``, the option's text or
   ``B) its text``) is the answer.

Letters ``A``-``J`` are options; with the options' texts given, only the letters of existing options.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from trl_sae.rewards.base import RewardFunction, graded_rows, required_column
from trl_sae.rewards.format import boxed_answers, final_part

__all__ = ["LETTERS", "extract_choice", "make_multiple_choice_accuracy", "multiple_choice_accuracy"]

#: The option letters a multiple-choice question may use.
LETTERS = "ABCDEFGHIJ"

_AMBIGUOUS = object()  # a statement naming two different options

# LaTeX wrappers whose content is the text: \text{B}, \textbf{B}, \mathrm{B}, \boxed{B} ...
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|mbox|boxed|fbox|emph)\s*\{([^{}]*)\}")
_EMPHASIS_RE = re.compile(r"\*+|(?<!\w)_{1,2}|_{1,2}(?!\w)|`+")

_CUE_RE = re.compile(
    r"\b(?:answer|option|choice)(?:\s+(?:choice|option|letter))?"
    r"\s*(?:\bis\b|\bwould\s+be\b|\bshould\s+be\b|\bmust\s+be\b|=|:|-)\s*:?",
    re.IGNORECASE,
)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_IS_CORRECT_RE = re.compile(
    r"(?<![\w\\])(?:option\s+|choice\s+)?(\([A-J]\)|[A-J])\s+is\s+(?:the\s+)?(?:correct|right|best)\b"
)
# The end of a cue's sentence: a line break, or . ! ? ; before whitespace (not the "." in 3.2).
_SENTENCE_END_RE = re.compile(r"\n|[.!?;](?=\s|$)")

_FULL_LETTER_RE = re.compile(r"[\(\[]?([A-Ja-j])[\)\]]?")
_LEADING_MARKER_RE = re.compile(r"(?:\(([A-Ja-j])\)|\[([A-Ja-j])\]|([A-J])[).:]|([a-j])\))(.*)", re.DOTALL)
_LEADING_BARE_RE = re.compile(r"([A-J])(?![\w'’])(.*)", re.DOTALL)
_SECOND_OPTION_RE = re.compile(
    r"\s*[.):]?\s*(?:,|/|&|\bor\b|\band\b|\bvs\.?)\s*(?:option\s+|choice\s+)?(?:\(([A-J])\)|([A-J])(?![\w'’]))",
    re.IGNORECASE,
)
_STANDALONE_RE = re.compile(r"(?<![\w\\'’])(?:\(([A-J])\)|([A-J])(?![\w'’]))")
_ARTICLE_RE = re.compile(r"\s+[a-z]")
_TRAILING = " \t\n.,;:!?"


def _clean(text: str) -> str:
    """Text without markdown emphasis, with LaTeX text wrappers unwrapped and ``$`` removed."""
    previous = None
    while previous != text:  # nested wrappers: \boxed{\text{B}}
        previous, text = text, _WRAPPER_RE.sub(r"\1", text)
    return _EMPHASIS_RE.sub("", text).replace("$", "")


def _norm(text: str) -> str:
    return " ".join(text.split()).strip(_TRAILING).strip("\"'“”").strip(_TRAILING).casefold()


class _Options:
    """The options' letters, and their texts when known (to match an answer given as text)."""

    def __init__(self, choices: Sequence[str] | None) -> None:
        self.texts = [_norm(_clean(str(c))) for c in choices] if choices else []
        self.letters = LETTERS[: len(self.texts)] if self.texts else LETTERS

    def letter(self, char: str | None) -> str | None:
        if char is None:
            return None
        char = char.upper()
        return char if char in self.letters else None

    def by_text(self, text: str) -> str | object | None:
        matches = {LETTERS[k] for k, t in enumerate(self.texts) if t and t == _norm(text)}
        if len(matches) > 1:
            return _AMBIGUOUS  # two options with the same text: the text cannot tell them apart
        return matches.pop() if matches else None

    def found_in(self, text: str) -> tuple[set[str], str]:
        """Letters of the options whose text occurs in ``text`` (not inside a longer option's match), and
        ``text`` with those occurrences blanked out."""
        spans: list[tuple[int, int, str]] = []
        for k, option in enumerate(self.texts):
            if not option:
                continue
            pattern = r"\s+".join(re.escape(word) for word in option.split())
            if option[0].isalnum():
                pattern = r"(?<!\w)" + pattern
            if option[-1].isalnum():
                pattern += r"(?!\w)"
            spans += [(m.start(), m.end(), LETTERS[k]) for m in re.finditer(pattern, text, re.IGNORECASE)]
        kept: list[tuple[int, int, str]] = []
        for start, end, letter in sorted(spans, key=lambda s: s[0] - s[1]):  # longest first
            if all(end <= s or start >= e for s, e, _ in kept):
                kept.append((start, end, letter))
        for start, end, _ in kept:
            text = text[:start] + " " * (end - start) + text[end:]
        return {letter for _, _, letter in kept}, text


def _leading(statement: str, options: _Options, strict: bool) -> str | object | None:
    """The option a statement starts with (``(B) ...``, ``B) ...``, ``B. ...``, ``B ...``), if any."""
    marker = _LEADING_MARKER_RE.fullmatch(statement)
    if marker is not None:
        char, rest = next(g for g in marker.groups()[:4] if g), marker.group(5)
    else:
        bare = _LEADING_BARE_RE.fullmatch(statement)
        if bare is None:
            return None
        char, rest = bare.groups()
        if strict and options.by_text(rest) != options.letter(char):
            return None  # a last line such as "A quick check ..." is no answer
    letter = options.letter(char)
    if letter is None:
        return None
    second = _SECOND_OPTION_RE.match(rest)
    if second is not None and options.letter(second.group(1) or second.group(2)) not in (None, letter):
        return _AMBIGUOUS
    if marker is None and letter in "AI" and _ARTICLE_RE.match(rest):
        # "A good choice is C", "I believe it is C": the article or the pronoun, when the rest names an
        # option; "A because ..." names none, so there A is the answer.
        inner = _parse_statement(rest, options)
        if inner is not None:
            return inner
    by_text = options.by_text(rest) if rest.strip(_TRAILING) else None
    if by_text is not None and by_text != letter:
        return _AMBIGUOUS  # "B) <the text of option C>"
    return letter


def _parse_statement(statement: str, options: _Options, strict: bool = False) -> str | object | None:
    """The letter a statement names, ``_AMBIGUOUS``, or ``None``; ``strict`` for a bare last line."""
    statement = _clean(statement).strip().strip(_TRAILING).strip()
    if not statement:
        return None
    full = _FULL_LETTER_RE.fullmatch(statement)
    if full is not None:
        return options.letter(full.group(1))
    by_text = options.by_text(statement)
    if by_text is not None:
        return by_text
    leading = _leading(statement, options, strict)
    if leading is not None or strict:
        return leading
    letters, rest = options.found_in(statement)
    for match in _STANDALONE_RE.finditer(rest):
        bare = match.group(2)
        if bare in ("A", "I") and _ARTICLE_RE.match(rest, match.end()):
            continue  # "A good answer ...", "I think ..."
        letter = options.letter(match.group(1) or bare)
        if letter is not None:
            letters.add(letter)
    if len(letters) > 1:
        return _AMBIGUOUS
    return letters.pop() if letters else None


def _statements(text: str) -> list[tuple[int, str]]:
    """``(position, statement)`` of every answer statement in ``text``, in order of position."""
    found: list[tuple[int, str]] = []
    boxed = boxed_answers(text)
    for match, content in zip(re.finditer(r"\\boxed\s*\{", text), boxed):
        if content is not None:
            found.append((match.start(), content))
    found += [(m.start(), m.group(1)) for m in _ANSWER_TAG_RE.finditer(text)]
    # Cues are read on the text with markdown emphasis and `$` blanked out ("**Answer:** B"), character for
    # character, so every statement's position is a position in `text` and the order is the text's.
    scan = _EMPHASIS_RE.sub(lambda m: " " * len(m.group()), text).replace("$", " ")
    for match in _CUE_RE.finditer(scan):
        rest = scan[match.end() :]
        end = _SENTENCE_END_RE.search(rest)
        found.append((match.end(), rest[: end.start() if end else len(rest)]))
    found += [(m.start(), m.group(1)) for m in _IS_CORRECT_RE.finditer(scan)]
    return sorted(found, key=lambda item: item[0])


def extract_choice(text: str, choices: Sequence[str] | None = None) -> str | None:
    """The letter of the option a completion chooses, or ``None`` (no answer, or an ambiguous one).

    Args:
        text: the completion.
        choices: the options' texts in letter order (``choices[1]`` is option B), so that an answer given
            as an option's text counts and letters past the last option do not; ``None``: letters only,
            ``A``-``J``.

    Example:
        >>> extract_choice("A good answer is C.")
        'C'
        >>> extract_choice("The answer is (A) or (C).") is None
        True
        >>> extract_choice("So it must be 3.2 m/s.\\n\\nAnswer: 3.2 m/s", ["1 m/s", "3.2 m/s"])
        'B'
    """
    final = final_part(text)
    if final is None:
        return None
    options = _Options(choices)
    for _, statement in reversed(_statements(final)):
        result = _parse_statement(statement, options)
        if result is _AMBIGUOUS:
            return None
        if result is not None:
            return result  # type: ignore[return-value]
    lines = [line for line in final.splitlines() if line.strip()]
    if not lines:
        return None
    result = _parse_statement(lines[-1], options, strict=True)
    return result if isinstance(result, str) else None


def _gold_letter(value: Any, index: int, column: str) -> str | None:
    if value is None:
        return None
    text = str(value).strip().strip("()").upper()
    if len(text) != 1 or text not in LETTERS:
        raise ValueError(
            f"multiple_choice_accuracy: row {index} of column {column!r} is {value!r}, not an option letter A-J; "
            "build the dataset with trl_sae.stem.load_multiple_choice_dataset or store the gold letter."
        )
    return text


class _MultipleChoice:
    """The callable behind :func:`multiple_choice` and :func:`make_multiple_choice_accuracy`."""

    def __init__(self, answer_column: str, choices_column: str | None, name: str) -> None:
        self.answer_column, self.choices_column, self.__name__ = answer_column, choices_column, name

    def __repr__(self) -> str:
        return (
            f"make_multiple_choice_accuracy(answer_column={self.answer_column!r}, "
            f"choices_column={self.choices_column!r}, name={self.__name__!r})"
        )

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        golds = required_column(
            columns,
            self.answer_column,
            reward=self.__name__,
            holds="the gold letters",
            fix="Use make_multiple_choice_accuracy(answer_column=...).",
            num_completions=len(completions),
        )
        choices = columns.get(self.choices_column) if self.choices_column else None
        scores: list[float | None] = [None] * len(completions)
        for i, text, letter in graded_rows(
            completions, golds, lambda value, i: _gold_letter(value, i, self.answer_column)
        ):
            options = choices[i] if choices is not None else None
            scores[i] = 1.0 if extract_choice(text, options or None) == letter else 0.0
        return scores


def make_multiple_choice_accuracy(
    *,
    answer_column: str = "answer",
    choices_column: str | None = "choices",
    name: str = "multiple_choice_accuracy",
) -> RewardFunction:
    """A :func:`multiple_choice_accuracy` reading other columns or logging under another name.

    Args:
        answer_column: the column with the gold letter (``"B"``).
        choices_column: the column with each row's option texts in letter order, so answers given as an
            option's text count; a batch without that column (or ``None`` here) is graded on letters only.
        name: the function's ``__name__`` (its metrics name).
    """
    return _MultipleChoice(answer_column, choices_column, name)


_DEFAULT = make_multiple_choice_accuracy()


def multiple_choice_accuracy(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 if a completion chooses the gold option (column ``answer``, a letter), else 0.0.

    The chosen option is read by :func:`extract_choice` (the last answer statement; letters or, with the
    ``choices`` column, the options' texts); no answer or an ambiguous one scores 0.0, a row without a
    gold letter ``None``. Datasets from :func:`trl_sae.stem.load_multiple_choice_dataset` have both columns.

    Example:
        >>> multiple_choice_accuracy(None, ["... the answer is **B**.", "Answer: 4 K", "(A) or (B)"], None,
        ...                 answer=["B", "A", "A"], choices=[["1", "2"], ["4 K", "5 K"], ["x", "y"]])
        [1.0, 1.0, 0.0]
    """
    return _DEFAULT(prompts, completions, completion_ids, **columns)
