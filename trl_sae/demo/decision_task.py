"""A long-horizon task with a few known decision tokens: walking through rooms (the ``decision`` task).

The regime the paper's argument is about: long completions in which almost every token is determined by
the context, and a handful of tokens where the policy genuinely chooses and where the outcome is decided.
The prompt names a start room and a pass number; the completion walks ``num_decisions`` steps through rooms
``a``-``g`` (``n_doors``), one line per step, then names the room it ends in::

    user:       Walk 8 from c pass 4821
    assistant:  1.4821:c>e walking  at e
                2.4821:e>a walking  at a
                ...
                8.4821:f>b walking  at b
                END b

On each line the letter after ``>`` is the **decision token**: the door taken, any door except the room one
is standing in (``c`` on line 1, then the previous line's door). Everything else is deterministic given the
context: the step number, the restated pass number and current room, a fixed stretch of filler text of
``filler_length`` characters (a verbose trace: what the paper posits for reasoning text, where most tokens
carry no choice), the restated new room, and the final ``END`` line.

* **Outcome reward only at the end**: :func:`walk_reward` is 1.0 iff the whole walk is well formed and no
  step takes the door of the room it is in, else 0.0.
* **Genuine uncertainty at the decisions**: the demonstrations come from a sloppy teacher that forgets the
  "not the door you are in" rule with probability ``teacher_error_rate`` and otherwise picks uniformly
  among the allowed doors. A policy that imitates it puts roughly ``(1 - q) / (n_doors - 1)`` on each
  allowed door and ``q`` on the forbidden one: with 7 doors every option is below 0.2, so probability
  segmentation at the paper's ``p = 0.2`` has a boundary to find at every decision, and the success rate
  is about ``(1 - q) ** num_decisions`` (0.85 ** 8 = 27% at the defaults). RL with the exact reward can
  learn the rule; the credit for a failure sits on one token among hundreds.
* **Known decision positions**: :func:`decision_char_positions` / :func:`decision_token_positions` return
  them for any completion (well formed or not), and :func:`boundary_precision_recall` scores a
  segmentation against them.
* **Knobs**: ``num_decisions`` and ``filler_length`` (the gap between decisions); a completion has
  ``num_decisions * (filler_length + 17) + 5`` characters (:func:`walk_length`; one token each with the
  demo's char tokenizer): 205 at the defaults.

Greedy decoding is not a meaningful accuracy here: the allowed doors are interchangeable, so the greedy
path is decided by near-ties. Success is measured by sampling at the training temperature
(:data:`DECISION_DEFAULTS` records the warm start's numbers).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from datasets import Dataset, DatasetDict

from trl_sae.demo.tasks import completion_text

__all__ = [
    "DECISION_DEFAULTS",
    "FILLER_TEXT",
    "TAG_DIGITS",
    "DecisionDefaults",
    "boundary_precision_recall",
    "decision_char_positions",
    "decision_segmentation",
    "decision_token_positions",
    "filler",
    "format_walk",
    "format_walk_prompt",
    "make_walk_dataset",
    "make_walk_splits",
    "prepare_walk_demo",
    "walk_length",
    "walk_reward",
]

# The filler: a fixed passage, cut to ``filler_length`` characters. Fixed so it is deterministic given the
# context (a warm-started model copies it with probability ~1), and made of distinct words so a tiny
# model always knows where in the passage it is.
FILLER_TEXT = (
    "walking down the long hall past old lamps, quiet maps, a wooden bench, two brass keys, "
    "faded rugs and one tall clock, then through the arch into the next room"
)
_LETTERS = string.ascii_lowercase
_PROMPT = re.compile(r"^Walk (\d+) from ([a-z]) via ([a-z]+)$")
# The head of a step line, matched leniently so decision positions exist on malformed lines too.
_STEP_HEAD = re.compile(r"^(\d+)\.([0-9]*):([a-z])>([a-z])")
# Digits of the pass number a prompt gives and every step line restates.
TAG_DIGITS = 4


def filler(filler_length: int) -> str:
    """The first ``filler_length`` characters of :data:`FILLER_TEXT` (the deterministic gap text)."""
    if not 0 <= filler_length <= len(FILLER_TEXT):
        raise ValueError(f"`filler_length` must be in [0, {len(FILLER_TEXT)}], got {filler_length}.")
    return FILLER_TEXT[:filler_length]


def format_walk_prompt(num_decisions: int, start: str, tag: str) -> str:
    """The user's request, e.g. ``"Walk 8 from c pass 4821"`` (the pass number is restated on every line)."""
    return f"Walk {num_decisions} from {start} pass {tag}"


def format_walk(start: str, tag: str, path: Sequence[str], filler_length: int) -> str:
    """The completion for a walk from ``start`` taking the doors in ``path`` (one line per step + END).

    Each step line restates the prompt's pass number and the current room before the decision
    (``3.4821:e>k``): the state a verbose trace carries along. Writes what is given, allowed or not: the
    reward, not the formatter, judges the walk.
    """
    gap = filler(filler_length)
    lines, room = [], start
    for step, door in enumerate(path, start=1):
        lines.append(f"{step}.{tag}:{room}>{door} {gap} at {door}")
        room = door
    lines.append(f"END {room}")
    return "\n".join(lines)


def walk_length(num_decisions: int, filler_length: int, n_doors: int) -> int:
    """Characters of a well-formed completion (= tokens with the demo's char tokenizer, EOS excluded)."""
    path = ["b" if i % 2 == 0 else "a" for i in range(num_decisions)]
    return len(format_walk("a", "0" * TAG_DIGITS, path, filler_length))


def decision_char_positions(text: str) -> list[int]:
    """Character offsets of the decision tokens (the door after ``>``) in a completion's text.

    Every line that starts like a step (``<n>:<room>><door>``) contributes its door's offset, whatever the
    rest of the line says, so sampled (possibly malformed) completions have their decisions located too.
    """
    positions, offset = [], 0
    for line in text.split("\n"):
        match = _STEP_HEAD.match(line)
        if match:
            positions.append(offset + match.start(4))
        offset += len(line) + 1
    return positions


def decision_token_positions(tokenizer: Any, completion_ids: Sequence[int]) -> list[int]:
    """Indices into ``completion_ids`` of the decision tokens.

    Decodes token by token and maps :func:`decision_char_positions` of the concatenated text back to the
    token holding each character, so it works for any tokenizer whose tokens decode to their own text
    (with the demo's char tokenizer, token index = character offset). Special tokens decode to nothing.
    """
    pieces = [tokenizer.decode([int(i)], skip_special_tokens=True) for i in completion_ids]
    owner: list[int] = []
    for index, piece in enumerate(pieces):
        owner.extend([index] * len(piece))
    return [owner[c] for c in decision_char_positions("".join(pieces))]


def boundary_precision_recall(
    boundaries: Sequence[Sequence[bool]] | torch.Tensor,
    decisions: Sequence[Sequence[int]],
    lengths: Sequence[int] | None = None,
) -> dict[str, float | int]:
    """Micro-averaged precision and recall of segment boundaries against the true decision positions.

    Args:
        boundaries: per completion, one flag per token (a ``(B, T)`` bool tensor or nested lists), True
            where a segment starts (e.g. :func:`trl_sae.core.segmentation.probability_boundaries`).
        decisions: per completion, the token indices of its decision tokens.
        lengths: per completion, the number of valid tokens (flags beyond it are ignored); all when None.

    Returns:
        ``true_positives`` (boundaries on a decision token), ``boundaries``, ``decisions``, ``precision``
        (share of boundaries on decision tokens; NaN with no boundary), ``recall`` (share of decision tokens
        that are boundaries; NaN with no decision) and ``boundaries_per_completion``.
    """
    if len(boundaries) != len(decisions):
        raise ValueError(f"Got {len(boundaries)} boundary rows but {len(decisions)} decision lists.")
    hits = flagged = wanted = 0
    for row, (flags, positions) in enumerate(zip(boundaries, decisions)):
        values = flags.tolist() if isinstance(flags, torch.Tensor) else list(flags)
        if lengths is not None:
            values = values[: int(lengths[row])]
        marked = {t for t, flag in enumerate(values) if bool(flag)}
        truth = {int(t) for t in positions if int(t) < len(values)}
        hits += len(marked & truth)
        flagged += len(marked)
        wanted += len(truth)
    nan = float("nan")
    return {
        "true_positives": hits,
        "boundaries": flagged,
        "decisions": wanted,
        "precision": hits / flagged if flagged else nan,
        "recall": hits / wanted if wanted else nan,
        "boundaries_per_completion": flagged / max(1, len(decisions)),
    }


def decision_segmentation(
    policy: Any,
    tokenizer: Any,
    dataset: Any,
    p_grid: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5),
    num_samples: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    batch_size: int = 128,
    seed: int = 0,
) -> dict[str, Any]:
    """Sample completions and score probability segmentation against the true decision tokens at each ``p``.

    Args:
        policy: the causal LM (sampled without top-k / top-p, on a forked RNG seeded with ``seed``).
        tokenizer: its tokenizer.
        dataset: rows of :func:`make_walk_dataset`.
        p_grid: thresholds of :func:`trl_sae.core.segmentation.probability_boundaries` to score.
        num_samples: completions per prompt.
        temperature: sampling temperature (the rollout temperature: boundaries are the ones PPO sees).
        max_new_tokens: generation budget; the well-formed length + 16 when None.
        batch_size: rows per ``generate`` call.
        seed: sampling seed.

    Returns:
        ``success`` (mean :func:`walk_reward` of the samples), ``mean_length`` (tokens, EOS included),
        ``decisions_per_completion``, ``by_p`` (``{p: boundary_precision_recall(...)}``), and ``samples``: per
        completion its ``ids``, ``logprobs``, ``decisions`` and ``reward`` (for reports).
    """
    from transformers import GenerationConfig

    from trl_sae.core.segmentation import probability_boundaries
    from trl_sae.demo.warmstart import encode_prompt
    from trl_sae.generation.capture import generate_with_logprobs

    rows = [dataset[i] for i in range(len(dataset)) for _ in range(num_samples)]
    if max_new_tokens is None:
        max_new_tokens = (
            max(walk_length(int(r["num_decisions"]), int(r["filler_length"]), len(r["doors"])) for r in rows)
            + 16
        )
    generation = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    device = next(policy.parameters()).device
    ids_out: list[list[int]] = []
    logprobs_out: list[list[float]] = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for begin in range(0, len(rows), batch_size):
            chunk = rows[begin : begin + batch_size]
            encoded = [encode_prompt(tokenizer, r["prompt"]) for r in chunk]
            width = max(len(e) for e in encoded)
            prompt_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
            prompt_mask = torch.zeros_like(prompt_ids)
            for i, e in enumerate(encoded):
                prompt_ids[i, width - len(e) :] = torch.tensor(e)
                prompt_mask[i, width - len(e) :] = 1
            out = generate_with_logprobs(policy, prompt_ids.to(device), prompt_mask.to(device), generation)
            lengths = out.completion_mask.sum(dim=1).tolist()
            for i, n in enumerate(lengths):
                ids_out.append(out.completion_ids[i, : int(n)].tolist())
                logprobs_out.append(out.logprobs[i, : int(n)].float().cpu().tolist())
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in ids_out]
    rewards = walk_reward(
        completions=texts,
        start=[r["start"] for r in rows],
        doors=[r["doors"] for r in rows],
        tag=[r["tag"] for r in rows],
        num_decisions=[r["num_decisions"] for r in rows],
        filler_length=[r["filler_length"] for r in rows],
    )
    decisions = [decision_token_positions(tokenizer, ids) for ids in ids_out]
    by_p = {}
    for p in p_grid:
        flags = [
            probability_boundaries(torch.tensor([lp]), torch.ones(1, len(lp)), p)[0].tolist() if lp else []
            for lp in logprobs_out
        ]
        by_p[float(p)] = boundary_precision_recall(flags, decisions)
    return {
        "success": sum(rewards) / len(rewards),
        "mean_length": sum(len(i) for i in ids_out) / len(ids_out),
        "decisions_per_completion": sum(len(d) for d in decisions) / len(decisions),
        "by_p": by_p,
        "samples": [
            {"ids": i, "logprobs": lp, "decisions": d, "reward": r, "prompt": row["prompt"]}
            for i, lp, d, r, row in zip(ids_out, logprobs_out, decisions, rewards, rows)
        ],
    }


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------
def _teacher_path(
    rng: random.Random, start: str, doors: str, num_decisions: int, error_rate: float
) -> list[str]:
    path, room = [], start
    for _ in range(num_decisions):
        # The sloppy teacher forgets the rule and walks back into the room it is in.
        door = room if rng.random() < error_rate else rng.choice([d for d in doors if d != room])
        path.append(door)
        room = door
    return path


def make_walk_dataset(
    n: int,
    num_decisions: int = 8,
    filler_length: int = 8,
    n_doors: int = 7,
    seed: int = 0,
    chat: bool = True,
    teacher_error_rate: float = 0.0,
    exclude: set[tuple[str, str]] | None = None,
) -> Dataset:
    """``n`` walking problems, deterministic in ``seed``.

    Args:
        n: number of rows.
        num_decisions: steps per walk (decision tokens per completion).
        filler_length: characters of deterministic filler on each step line (the gap between decisions).
        n_doors: size of each problem's door set (distinct lowercase letters); the start room is one of them.
        seed: RNG seed (a private ``random.Random``).
        chat: prompts as chat messages if True, plain text if False.
        teacher_error_rate: probability that a demonstration step takes the forbidden door (the room it is
            in); otherwise the step is uniform over the allowed doors.
        exclude: ``(start, tag)`` problems never to emit (the train split, when building a held-out one).

    Returns:
        A ``Dataset`` with ``prompt``, ``start``, ``tag``, ``doors`` (the first ``n_doors`` letters),
        ``num_decisions``, ``filler_length``,
        ``solution`` (the teacher's demonstration, for SFT) and ``solution_is_correct``.
    """
    if num_decisions < 1:
        raise ValueError(f"`num_decisions` must be >= 1, got {num_decisions}.")
    if not 2 <= n_doors <= len(_LETTERS):
        raise ValueError(f"`n_doors` must be in [2, 26], got {n_doors}.")
    if not 0.0 <= teacher_error_rate <= 1.0:
        raise ValueError(f"`teacher_error_rate` must be in [0, 1], got {teacher_error_rate}.")
    filler(filler_length)  # validates the length
    rng = random.Random(f"walk-{seed}")
    # The teacher's coin flips have their own stream: the problems are the same whatever the error rate.
    teacher = random.Random(f"walk-teacher-{seed}")
    excluded = exclude or set()
    # The doors are fixed (the first n_doors letters): the choice is among them, the pass number and the
    # start make problems distinct.
    doors = _LETTERS[:n_doors]
    rows: dict[str, list[Any]] = {
        key: []
        for key in (
            "prompt",
            "start",
            "tag",
            "doors",
            "num_decisions",
            "filler_length",
            "solution",
            "solution_is_correct",
        )
    }
    seen: set[tuple[str, str]] = set()
    attempts = 0
    while len(rows["start"]) < n:
        attempts += 1
        if attempts > 100 * max(n, 1) + 1000:
            raise ValueError(f"Could not draw {n} distinct problems outside `exclude`; lower `n`.")
        start = rng.choice(doors)
        tag = "".join(rng.choice(string.digits) for _ in range(TAG_DIGITS))
        if (start, tag) in excluded or (start, tag) in seen:
            continue
        seen.add((start, tag))
        path = _teacher_path(teacher, start, doors, num_decisions, teacher_error_rate)
        text = format_walk_prompt(num_decisions, start, tag)
        solution = format_walk(start, tag, path, filler_length)
        rows["prompt"].append([{"role": "user", "content": text}] if chat else text)
        rows["start"].append(start)
        rows["tag"].append(tag)
        rows["doors"].append(doors)
        rows["num_decisions"].append(num_decisions)
        rows["filler_length"].append(filler_length)
        rows["solution"].append(solution)
        rows["solution_is_correct"].append(
            _walk_is_correct(solution, start, tag, doors, num_decisions, filler_length)
        )
    return Dataset.from_dict(rows)


def make_walk_splits(
    n_train: int,
    n_test: int,
    num_decisions: int = 8,
    filler_length: int = 8,
    n_doors: int = 7,
    seed: int = 0,
    chat: bool = True,
    teacher_error_rate: float = 0.0,
) -> DatasetDict:
    """A ``train`` split (sloppy demonstrations) and a held-out ``test`` split of unseen problems."""
    train = make_walk_dataset(
        n_train, num_decisions, filler_length, n_doors, seed, chat, teacher_error_rate=teacher_error_rate
    )
    seen = set(zip(train["start"], train["tag"]))
    test = make_walk_dataset(n_test, num_decisions, filler_length, n_doors, seed + 1, chat, exclude=seen)
    return DatasetDict({"train": train, "test": test})


# --------------------------------------------------------------------------------------------------
# Verifiable reward
# --------------------------------------------------------------------------------------------------
def _walk_is_correct(
    text: str, start: str, tag: str, doors: str, num_decisions: int, filler_length: int
) -> bool:
    """The exact format of :func:`format_walk` and every door allowed (in the set, not the current room)."""
    lines = text.strip().split("\n")
    if len(lines) != num_decisions + 1:
        return False
    gap = filler(filler_length)
    room = start
    for step, line in enumerate(lines[:-1], start=1):
        head = f"{step}.{tag}:{room}>"
        if not line.startswith(head) or len(line) != len(head) + 1 + len(f" {gap} at x"):
            return False
        door = line[len(head)]
        if door not in doors or door == room or line[len(head) + 1 :] != f" {gap} at {door}":
            return False
        room = door
    return lines[-1] == f"END {room}"


def walk_reward(
    prompts: list[Any] | None = None,
    completions: list[Any] | None = None,
    completion_ids: list[list[int]] | None = None,
    start: list[str] | None = None,
    doors: list[str] | None = None,
    tag: list[str] | None = None,
    num_decisions: list[int] | None = None,
    filler_length: list[int] | None = None,
    **kwargs: Any,
) -> list[float]:
    """Outcome reward: 1.0 iff the completion is a well-formed walk that never takes the current room's door.

    TRL's reward-function protocol (the dataset's ``start``, ``tag``, ``doors``, ``num_decisions`` and
    ``filler_length`` columns arrive as keyword lists). Strict on the format: the deterministic stretches
    are part of the task, as the answer format is in the running-sum task.
    """
    if (
        completions is None
        or start is None
        or doors is None
        or tag is None
        or num_decisions is None
        or filler_length is None
    ):
        raise ValueError(
            "walk_reward needs `completions` and the dataset's `start`, `tag`, `doors`, `num_decisions` and "
            "`filler_length` columns."
        )
    if (
        not len(completions)
        == len(start)
        == len(tag)
        == len(doors)
        == len(num_decisions)
        == len(filler_length)
    ):
        raise ValueError(f"Got {len(completions)} completions but {len(start)} rows of problem columns.")
    return [
        1.0 if _walk_is_correct(completion_text(c), s, g, d, int(k), int(f)) else 0.0
        for c, s, g, d, k, f in zip(completions, start, tag, doors, num_decisions, filler_length)
    ]


# --------------------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecisionDefaults:
    """The decision task and its warm start, as the long-horizon benchmark and ``trl-sae demo --task
    decision`` use them (measurements in the comment below :data:`DECISION_DEFAULTS`)."""

    num_decisions: int = 8
    filler_length: int = 8
    n_doors: int = 7
    teacher_error_rate: float = 0.15
    n_train: int = 2000
    n_test: int = 200
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    sft_max_steps: int = 400
    sft_learning_rate: float = 3e-3
    sft_batch_size: int = 32
    sft_warmup_steps: int = 10
    # The paper's rollout temperature (as the running-sum demo): it sharpens the deterministic stretches
    # (at T = 1 a 0.99-probability token still fails once per ~100, i.e. most 200-token walks break
    # somewhere) and leaves the interchangeable doors at ~1/7 each.
    rollout_temperature: float = 0.6

    @property
    def completion_length(self) -> int:
        """Characters (= char-tokenizer tokens) of a well-formed completion, EOS excluded."""
        return walk_length(self.num_decisions, self.filler_length, self.n_doors)

    @property
    def max_new_tokens(self) -> int:
        """Generation budget: a well-formed completion plus EOS and a margin for malformed ones."""
        return self.completion_length + 16

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Measured (seed 0, torch 2.13 CPU, 1 thread; make_walk_splits -> build_tiny_qwen3 -> sft_warm_start ->
# decision_segmentation on 100 held-out prompts x 2 samples at T = 0.6):
# * 400 SFT steps: 128 s of CPU at filler 8 (205-token walks); filler 32 (397 tokens) about 2x.
# * Success 25.5% (22.5% with benchmarks/long_horizon.py's evaluation seed) vs the teacher's 0.85 ** 8 = 27%;
#   8.0 boundaries per completion at p = 0.2, precision 0.998 and recall 1.00 against the decision tokens;
#   at p <= 0.1 almost none (every door sits near 1/7). Filler 32: 22.0%, 8.3 boundaries, 0.95 / 0.99.
# * At T = 1.0 the same model succeeds 5% of the time: one stray token somewhere in 200 deterministic ones
#   breaks most walks, hence the paper's 0.6.
# * Tried first (benchmarks/experiments/archive/long-horizon.md): a per-problem door set listed in the prompt;
#   300-800 SFT steps left a third of the decisions outside the set and success at 0-1%.
DECISION_DEFAULTS = DecisionDefaults()


def prepare_walk_demo(defaults: DecisionDefaults | None = None, progress: bool = True) -> Any:
    """The decision task's counterpart of :func:`trl_sae.demo.warmstart.prepare_demo`: splits, a tiny Qwen3
    and its SFT warm start on the sloppy teacher's walks (deterministic in ``defaults.seed``).

    Returns:
        A :class:`trl_sae.demo.warmstart.DemoSetup` (``defaults`` holds the ``DecisionDefaults``).
    """
    from trl_sae.demo.warmstart import warm_start_on_splits

    defaults = defaults or DECISION_DEFAULTS
    splits = make_walk_splits(
        defaults.n_train,
        defaults.n_test,
        num_decisions=defaults.num_decisions,
        filler_length=defaults.filler_length,
        n_doors=defaults.n_doors,
        seed=defaults.seed,
        teacher_error_rate=defaults.teacher_error_rate,
    )
    return warm_start_on_splits(splits, defaults, progress)
