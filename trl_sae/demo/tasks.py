"""A synthetic multi-step arithmetic task with a verifiable answer: running sums.

The prompt asks for the sum of a few small numbers; the ideal completion adds them one at a time, one
step per line, and ends with an answer line::

    user:       Add: 3 5 2 7
    assistant:  3+5=8
                8+2=10
                10+7=17
                ANSWER 17

Why this task for the offline demo and the benchmarks:

* the answer is checkable exactly (the reward is 1.0 iff the last answer line states the gold sum),
  so it is a faithful miniature of RL with verifiable rewards;
* it is multi-step: one wrong intermediate sum makes the final answer wrong, so credit assignment
  inside the completion matters, which is the point of segment-level advantages;
* difficulty is two knobs (number of terms, size of the terms), and the ``"long"`` variant makes
  completions several times longer, which is where segmentation has something to segment;
* completions stay short (about 20-40 characters at the defaults), so a character-level tiny Qwen3
  trains and samples quickly on a CPU;
* ``teacher_error_rate`` makes the SFT demonstrations come from a sloppy teacher that forgets to carry
  the one. A model that imitates it has learned the format and the arithmetic but takes the carry fork
  the wrong way most of the time: low greedy accuracy that RL with the exact reward can raise quickly,
  which is what the offline demo needs (``DEMO_DEFAULTS`` records the measurements).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from datasets import Dataset, DatasetDict

__all__ = [
    "ANSWER_PREFIX",
    "DEMO_DEFAULTS",
    "TASK_VARIANTS",
    "DemoDefaults",
    "completion_text",
    "extract_answer",
    "format_prompt",
    "format_solution",
    "make_running_sum_dataset",
    "make_running_sum_splits",
    "running_sum_reward",
]

ANSWER_PREFIX = "ANSWER"
PROMPT_PREFIX = "Add:"

# Number of terms (inclusive range) and largest term per variant. "default" keeps completions around
# 20-40 characters; "long" has 3x as many steps (about 80-130 characters), for the sample-efficiency
# benchmark where segmentation has long responses to cut.
TASK_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"num_terms": (3, 4), "max_value": 9},
    "long": {"num_terms": (9, 12), "max_value": 9},
}

# A strict answer line: the prefix, one space, an optional sign and digits, nothing else. Being strict
# on purpose: the task defines the format, and a reward that accepts "ANSWER: about 17" would reward
# format drift. (docs/design.md asks for math-verify on real math datasets; this synthetic task has an exact
# integer answer in a fixed format, for which a regex is the precise verifier.)
_ANSWER_LINE = re.compile(rf"^{ANSWER_PREFIX} (-?\d+)$")


# --------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------
def format_prompt(terms: Sequence[int]) -> str:
    """The user's request, e.g. ``"Add: 3 5 2 7"``."""
    return f"{PROMPT_PREFIX} " + " ".join(str(int(x)) for x in terms)


def _carries(total: int, term: int) -> bool:
    return (total % 10) + (term % 10) >= 10


def format_solution(terms: Sequence[int], dropped_carries: Sequence[bool] | None = None) -> str:
    """The worked completion: one running-sum step per line, then ``"ANSWER <sum>"``.

    Writing both operands on every line (``"8+2=10"``) rather than only the running total keeps each
    step a local two-operand addition the model can attend to, instead of a lookup across the prompt.

    Args:
        terms: the numbers to add.
        dropped_carries: per step (``len(terms) - 1`` flags), write that step the way a sloppy student
            does when it forgets to carry the one (``18+5=13``): the flag only matters on steps that
            carry, and later steps continue from the wrong total, so the final answer is wrong.
    """
    if len(terms) < 2:
        raise ValueError(f"A running sum needs at least 2 terms, got {list(terms)}.")
    flags = list(dropped_carries) if dropped_carries is not None else [False] * (len(terms) - 1)
    if len(flags) != len(terms) - 1:
        raise ValueError(f"`dropped_carries` needs {len(terms) - 1} flags, got {len(flags)}.")
    total = int(terms[0])
    lines = []
    for x, drop in zip(terms[1:], flags):
        new_total = total + int(x)
        if drop and _carries(total, int(x)):
            new_total -= 10
        lines.append(f"{total}+{int(x)}={new_total}")
        total = new_total
    lines.append(f"{ANSWER_PREFIX} {total}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------
def _resolve_variant(
    variant: str | None, num_terms: tuple[int, int] | None, max_value: int | None
) -> tuple[tuple[int, int], int]:
    if variant is not None and variant not in TASK_VARIANTS:
        raise ValueError(f"Unknown task variant {variant!r}; choose one of {sorted(TASK_VARIANTS)}.")
    preset = TASK_VARIANTS[variant or "default"]
    lo, hi = num_terms if num_terms is not None else preset["num_terms"]
    max_value = int(max_value if max_value is not None else preset["max_value"])
    if not 2 <= lo <= hi:
        raise ValueError(f"`num_terms` must be (lo, hi) with 2 <= lo <= hi, got {(lo, hi)}.")
    if max_value < 1:
        raise ValueError(f"`max_value` must be >= 1, got {max_value}.")
    return (int(lo), int(hi)), max_value


def _sample_terms(rng: random.Random, num_terms: tuple[int, int], max_value: int) -> tuple[int, ...]:
    k = rng.randint(num_terms[0], num_terms[1])
    # Terms start at 1: a 0 term is a no-op step that teaches nothing about carrying.
    return tuple(rng.randint(1, max_value) for _ in range(k))


def _build(terms_list: list[tuple[int, ...]], chat: bool, teacher_error_rate: float, seed: int) -> Dataset:
    # The teacher's coin flips come from their own RNG so the problems (and the held-out split) are the
    # same whatever the error rate.
    teacher_rng = random.Random(f"running-sum-teacher-{seed}")
    prompts: list[Any] = []
    solutions: list[str] = []
    for terms in terms_list:
        text = format_prompt(terms)
        prompts.append([{"role": "user", "content": text}] if chat else text)
        drops = [teacher_rng.random() < teacher_error_rate for _ in range(len(terms) - 1)]
        solutions.append(format_solution(terms, drops))
    answers = [str(sum(t)) for t in terms_list]
    return Dataset.from_dict(
        {
            "prompt": prompts,
            # A string, like the answers of real math datasets, so generic math rewards also accept it.
            "answer": answers,
            "solution": solutions,
            "solution_is_correct": [extract_answer(s) == int(a) for s, a in zip(solutions, answers)],
            "terms": [list(t) for t in terms_list],
        }
    )


def make_running_sum_dataset(
    n: int,
    num_terms: tuple[int, int] | None = None,
    max_value: int | None = None,
    seed: int = 0,
    chat: bool = True,
    variant: str | None = None,
    exclude: set[tuple[int, ...]] | None = None,
    teacher_error_rate: float = 0.0,
) -> Dataset:
    """``n`` running-sum problems, deterministic in ``seed``.

    Args:
        n: number of rows.
        num_terms: inclusive ``(lo, hi)`` range of the number of terms; defaults to the variant's.
        max_value: terms are drawn uniformly from ``1..max_value``; defaults to the variant's.
        seed: RNG seed (a private ``random.Random``, so global RNG state is untouched).
        chat: ``prompt`` as a list of chat messages (``[{"role": "user", ...}]``) if True, plain text if
            False. Chat prompts go through the tokenizer's chat template in TRL trainers.
        variant: ``"default"`` or ``"long"`` (see ``TASK_VARIANTS``); explicit arguments override it.
        exclude: problems (tuples of terms) never to emit, e.g. the training set when building a held-out
            split. Raises if the problem space is too small to find ``n`` others.
        teacher_error_rate: probability that the demonstration in ``solution`` forgets the carry on a
            step that carries (a sloppy teacher). ``answer`` is always the true sum, so a model that
            imitates the teacher learns a policy that is sometimes wrong in one specific, fixable way,
            and RL with the verifiable reward has something to correct (see ``DEMO_DEFAULTS``).

    Returns:
        A ``Dataset`` with columns ``prompt``, ``answer`` (the gold sum, a string), ``solution`` (the
        worked demonstration, for SFT), ``solution_is_correct`` (whether the demonstration reaches
        ``answer``) and ``terms`` (the integers).
    """
    if not 0.0 <= teacher_error_rate <= 1.0:
        raise ValueError(f"`teacher_error_rate` must be in [0, 1], got {teacher_error_rate}.")
    (lo, hi), max_value = _resolve_variant(variant, num_terms, max_value)
    rng = random.Random(seed)
    excluded = exclude or set()
    terms_list: list[tuple[int, ...]] = []
    attempts = 0
    while len(terms_list) < n:
        attempts += 1
        if attempts > 100 * max(n, 1) + 1000:
            raise ValueError(
                f"Could not draw {n} problems outside `exclude` with num_terms={(lo, hi)}, "
                f"max_value={max_value}; widen the problem space or lower `n`."
            )
        terms = _sample_terms(rng, (lo, hi), max_value)
        if terms in excluded:
            continue
        terms_list.append(terms)
    return _build(terms_list, chat, teacher_error_rate, seed)


def make_running_sum_splits(
    n_train: int,
    n_test: int,
    num_terms: tuple[int, int] | None = None,
    max_value: int | None = None,
    seed: int = 0,
    chat: bool = True,
    variant: str | None = None,
    teacher_error_rate: float = 0.0,
) -> DatasetDict:
    """A ``train`` split (seed ``seed``) and a held-out ``test`` split (seed ``seed + 1``).

    No test problem appears in the train split, so held-out accuracy measures arithmetic, not recall.
    ``teacher_error_rate`` applies to the train split's demonstrations only; test demonstrations are
    always correct (they serve as references, never as training targets).
    """
    train = make_running_sum_dataset(
        n_train, num_terms, max_value, seed, chat, variant, teacher_error_rate=teacher_error_rate
    )
    seen = {tuple(t) for t in train["terms"]}
    test = make_running_sum_dataset(n_test, num_terms, max_value, seed + 1, chat, variant, exclude=seen)
    return DatasetDict({"train": train, "test": test})


# --------------------------------------------------------------------------------------------------
# Verifiable reward
# --------------------------------------------------------------------------------------------------
def completion_text(completion: Any) -> str:
    """The text of one completion as TRL passes it: a string, or chat messages (the last one's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, Sequence) and len(completion) > 0:
        return completion_text(completion[-1])
    return ""


def extract_answer(text: str) -> int | None:
    """The integer on the completion's last non-empty line if it is exactly ``"ANSWER <int>"``, else None.

    Only the last line counts: a completion that states an answer and keeps writing has not committed to
    it (and stopping is part of the task). Surrounding whitespace is ignored.
    """
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    match = _ANSWER_LINE.match(lines[-1])
    return int(match.group(1)) if match else None


def running_sum_reward(
    prompts: list[Any] | None = None,
    completions: list[Any] | None = None,
    completion_ids: list[list[int]] | None = None,
    answer: list[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    """Verifiable outcome reward: 1.0 iff the final answer line equals the gold sum, else 0.0.

    Follows TRL's reward-function protocol (``prompts``, ``completions``, ``completion_ids`` and the
    dataset's columns as keyword lists), so it plugs into TRL trainers and ``evaluate_accuracy`` alike.
    No partial credit: the demo and benchmarks measure exactly what accuracy measures.

    Args:
        prompts: unused (accepted for the protocol).
        completions: strings, or chat messages ``[{"role": "assistant", "content": ...}]``.
        completion_ids: unused.
        answer: gold sums, one per completion (strings or ints).

    Returns:
        One float per completion.
    """
    if completions is None or answer is None:
        raise ValueError("running_sum_reward needs `completions` and the dataset's `answer` column.")
    if len(completions) != len(answer):
        raise ValueError(f"Got {len(completions)} completions but {len(answer)} answers.")
    rewards = []
    for completion, gold in zip(completions, answer):
        predicted = extract_answer(completion_text(completion))
        try:
            gold_value = int(str(gold).strip())
        except ValueError as error:
            raise ValueError(f"Gold answer {gold!r} is not an integer.") from error
        rewards.append(1.0 if predicted is not None and predicted == gold_value else 0.0)
    return rewards


# --------------------------------------------------------------------------------------------------
# Demo defaults
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoDefaults:
    """Everything the offline ``trl-sae demo`` fixes before its PPO stage (see ``DEMO_DEFAULTS``)."""

    # Task: the default variant, demonstrations from a teacher that forgets 60% of its carries.
    variant: str = "default"
    num_terms: tuple[int, int] = (3, 4)
    max_value: int = 9
    teacher_error_rate: float = 0.6
    n_train: int = 2000
    n_test: int = 200
    seed: int = 0
    # Model: trl_sae.demo.tiny.build_tiny_qwen3 (about 120k parameters).
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_heads (16); the vLLM demo uses 32
    # Warm start: trl_sae.demo.warmstart.sft_warm_start.
    sft_max_steps: int = 600
    sft_learning_rate: float = 3e-3
    sft_batch_size: int = 32
    sft_warmup_steps: int = 10
    # Evaluation and rollouts.
    max_new_tokens: int = 48
    eval_batch_size: int = 100
    rollout_temperature: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# How these were chosen (2 shared CPU cores, torch 2.13 CPU, torch.set_num_threads(1); every number comes
# from make_running_sum_splits -> build_tiny_qwen3 -> sft_warm_start -> evaluate_accuracy on the 200
# held-out prompts, and the seed-0 lines are reproduced exactly by
#   python -c "import torch; torch.set_num_threads(1); from trl_sae.demo.warmstart import prepare_demo; \
#              prepare_demo()"   followed by evaluate_accuracy(..., running_sum_reward) on its test split):
#
# * Build + SFT: 38.6-46 s of CPU time for 600 steps (about 15 steps per CPU-second). Wall time was 80-130 s
#   only because 4-8 other jobs shared the 2 cores; on an idle machine wall ~= CPU time. Greedy evaluation
#   of the 200 held-out prompts takes ~0.5 s, 8 samples x 100 prompts at T=1.0 ~2 s.
# * After SFT, greedy held-out accuracy 16.0% / 13.5% / 14.5% (seeds 0 / 1 / 2); sampled accuracy at
#   T=1.0 (8 samples on 100 prompts) 28% / 22% / 22%, pass@8 83% / 73% / 71%. Almost every greedy error
#   is the teacher's dropped carry (seed 0: 147 all-carries-dropped, 18 some dropped, 3 other errors
#   out of 168), i.e. the model has learned the format and the arithmetic, and the carry is a fork it
#   takes the wrong way about 60% of the time: exactly what a verifiable reward can fix.
# * RL has room: crude on-policy loops from the seed-0 warm start (16 prompts x 8 samples at T=1.0 per
#   iteration, AdamW lr 3e-4 with 10 warm-up steps, 60 s): rejection sampling (SFT on the correct
#   samples) took greedy held-out accuracy 16% -> 90% after 20 iterations and 92% after 48; REINFORCE
#   with a per-prompt mean baseline 16% -> 88% (20 iterations) -> 92.5% (41); T=1.0 accuracy
#   28% -> 67-74%.
#
# What did not work, and why the recipe looks like this:
# * Brief SFT on correct demonstrations (2 layers, 100 / 150 / 200 / 300 steps: greedy 6 / 27.5 / 37.5 /
#   72%) leaves the model high-entropy everywhere (T=1.0 accuracy 14% at 200 steps). The same crude RL
#   loops then lowered accuracy (37.5% -> 4-34%): a fresh optimizer's first steps knock the fragile
#   greedy path around, and many T=1.0 "correct" samples are lucky guesses whose garbage steps get
#   reinforced.
# * 2 layers cannot reliably learn to fetch the next term (copy errors dominate); 3 layers can
#   (clean data, 400 steps: 97% greedy). With the sloppy teacher, 300-400 steps left some seeds
#   unconverged (40-60% of errors not carry-related); 600 steps converged all three seeds.
#   lr 5e-3 or batch 64 x 400 steps were not better per CPU second.
#
# Note for segmentation: the carry fork is a ~0.4 / 0.6 choice, so probability segmentation at the
# paper's p = 0.2 rarely cuts there (the low-probability tokens it does mark are mostly wrong answers);
# p ~= 0.5 puts a boundary on each sampled minority branch of the fork.
DEMO_DEFAULTS = DemoDefaults()
