"""Critics of known error on the walk task: does SAE beat GAE when the critic is wrong, and lose when it is right?

Issues 22 and 30. The critic is replaced by an *oracle* whose error is chosen (:class:`CriticError`), or kept
as the trainer's own learned critic on walks that end at their first violation; every critic arm x estimator x
seed is trained from the same warm start (:class:`WalkPPOTrainer`, which overrides the trainer's phases only),
with the long-horizon benchmark's held-out evaluation, and analysed by the pre-registered tests of
benchmarks/experiments/known-error-critic-issue30.md ("Issue 30: pre-registration").

The oracle value (index convention of docs/design.md: ``values[t]`` is the value of the state *before*
completion token ``t``):

* A completion **fails** at the first character that no correct walk can have there (:func:`scan_walk`: the
  exact text of :func:`trl_sae.demo.decision_task.format_walk` with any allowed door at each decision; only
  whitespace may follow the final ``END <room>``). ``V*[t] = 0`` once the failing token is among tokens
  ``0 .. t-1``.
* Otherwise ``V*[t] = rate ** k_t``: ``k_t`` decisions are still ahead (decision doors at token ``t`` or
  later), and ``rate`` is the **per-decision success rate measured from the batch**: among the decision doors
  of this batch's completions that were reached with a still-correct prefix, the fraction that were allowed
  (:func:`per_decision_success_rate`). The deterministic stretches are treated as certain (the warm start
  copies them with probability ~1 at T = 0.6; see the README's measurements).
* The arms (:func:`walk_values`): ``exact`` (``V*``); ``iid<sigma>`` (``V*`` plus ``N(0, sigma^2)`` per
  token, seeded by ``(noise_seed, step)``, on valid positions only, not clipped: issue 22's arm);
  ``blind<mix>`` (failure-blind: ``(1 - mix) V* + mix rate ** k_t``); ``stale`` (``V*`` of the first batch's
  rate, the warm start's); ``constant`` (the batch's mean outcome); ``learned`` (the trainer's critic, with
  ``learned_warmup_steps`` critic-only steps first and its walks cut after their first failing character,
  :func:`end_walks_at_violation`, so that the true value is a function of the position and the decisions
  done; :class:`WarmupCheck` records its held-out explained variance after the warm-up).

An oracle arm needs no critic forward pass and no critic training: :class:`WalkPPOTrainer` then runs its PPO
loss without the critic (:class:`OracleCriticUpdate`, ``loss(..., with_critic=False)``), so the critic model the trainer builds is
never called nor updated, and the returns are read by nothing but the ``critic/explained_variance`` metric.
With ``advantage_scale="std"`` (the default) every estimator's advantages are divided by their std over the
batch (not centred), so one learning rate and one NLL weight mean the same for every estimator.

Runs go through the resumable runner of ``_common.py`` (``run_jobs``): each run's JSON is written to
``runs/`` when it finishes, a rerun skips finished runs, ``--commit`` git-commits each one.

Outputs (``--output-dir``, default ``benchmarks/results/known_error_critic/issue30/``): ``results.json`` (settings,
per-run curves and rates, summary, tests), ``results.md`` (tables), ``runs/*.json``, ``final_success.png``,
``learning_curves.png``, ``command.txt``, ``run.log``. ``--power`` prints the pre-registration's power table.

``python benchmarks/known_error_critic.py --smoke`` runs every stage on tiny sizes in seconds (not a result).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import _sweep as sweep
import long_horizon as lh
import sample_efficiency as se
from transformers import TrainerCallback

from trl_sae import SAEPPOTrainer
from trl_sae.demo.decision_task import filler
from trl_sae.trainer.parts.rollout import Rollouts
from trl_sae.trainer.parts.update import PPOUpdate

ESTIMATORS = ("sae", "gae", "mc", "adaptive_lambda")
# The NLL weight that defends the start-room copy under advantage_scale "std": 16 was pre-registered, and its
# pre-registered check on tuning seeds 100-103 (3 of 8 exact-critic runs collapsed) doubled it (README, issue 30).
PRE_REGISTERED_NLL = 32.0
_SCRIPT = "benchmarks/known_error_critic.py"
# issue 22's outputs stay in results/known_error_critic/; the pre-registered sweep writes below it.
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results" / "known_error_critic" / "issue30"
# The advantages' scale too: without whitening each estimator's step size is its own (see the README).
TRAIN_KEYS = (*se.TRAIN_KEYS, "advantages/mean", "advantages/std")


# --------------------------------------------------------------------------------------------------
# The oracle value
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WalkScan:
    """Where a completion's text stops being a correct walk, and the decisions reached before that.

    ``fail``: character offset of the first character no correct walk has there (None: none; a complete walk
    followed by whitespace only, or a correct but unfinished prefix). ``decisions``: character offsets of the
    decision doors reached with a correct prefix (the failing door included when a door is what fails).
    ``violations``: how many of those doors were not allowed (0 or 1: the walk fails at the first one).
    """

    fail: int | None
    decisions: tuple[int, ...]
    violations: int


def scan_walk(
    text: str, start: str, tag: str, doors: str, num_decisions: int, filler_length: int
) -> WalkScan:
    """Scan ``text`` against every correct walk (:func:`~trl_sae.demo.decision_task.format_walk` with any
    allowed door: in ``doors`` and not the current room); see :class:`WalkScan`."""
    gap = filler(filler_length)
    position, room = 0, start
    decisions: list[int] = []

    def expect(literal: str) -> int | None:
        # The first offset where ``text`` departs from ``literal`` read at ``position`` (None: it matches as
        # far as ``text`` goes).
        for i, char in enumerate(literal):
            if position + i >= len(text):
                return None
            if text[position + i] != char:
                return position + i
        return None

    for step in range(1, num_decisions + 1):
        head = f"{step}.{tag}:{room}>"
        bad = expect(head)
        if bad is not None or position + len(head) >= len(text):
            return WalkScan(bad, tuple(decisions), 0)
        position += len(head)
        door = text[position]
        decisions.append(position)
        if door not in doors or door == room:
            return WalkScan(position, tuple(decisions), 1)
        position += 1
        tail = f" {gap} at {door}\n"
        bad = expect(tail)
        if bad is not None or position + len(tail) > len(text):
            return WalkScan(bad, tuple(decisions), 0)
        position += len(tail)
        room = door
    bad = expect(f"END {room}")
    if bad is not None:
        return WalkScan(bad, tuple(decisions), 0)
    position += len(f"END {room}")
    extra = next((i for i in range(position, len(text)) if not text[i].isspace()), None)
    return WalkScan(extra, tuple(decisions), 0)


def per_decision_success_rate(scans: Sequence[WalkScan]) -> float:
    """Allowed doors / decision doors reached with a correct prefix, over the batch (1.0 with no decision)."""
    reached = sum(len(scan.decisions) for scan in scans)
    return 1.0 - sum(scan.violations for scan in scans) / reached if reached else 1.0


def _token_starts(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Character offset at which each token's text starts (special tokens decode to nothing)."""
    starts, offset = [], 0
    for token in ids:
        starts.append(offset)
        offset += len(tokenizer.decode([int(token)], skip_special_tokens=True))
    return starts


# --------------------------------------------------------------------------------------------------
# Critic errors (issue 30): what the values are, given where each walk stands
# --------------------------------------------------------------------------------------------------
CRITIC_KINDS = ("exact", "iid", "blind", "stale", "constant", "learned")


@dataclass(frozen=True)
class CriticError:
    """One kind of critic error on the walk task (issue 30). Its :attr:`name` is how the sweep spells it.

    * ``exact``: the oracle ``V*`` (``rate ** k_t`` before the walk fails, 0 after).
    * ``iid``: ``V*`` plus ``N(0, sigma^2)`` per token: zero-mean and independent of the state, so it cannot bias
      any estimator's gradient (the arm of issue 22's sweep).
    * ``blind``: failure-blind, ``(1 - mix) V* + mix rate ** k_t``: with ``mix`` 1 the position-only value, a
      critic that knows how many decisions are ahead but not that the walk already failed.
    * ``stale``: ``V*`` of an earlier policy: ``old_rate ** k_t`` before the failure (the trainer's old rate is
      the per-decision rate of its first batch, the warm start's).
    * ``constant``: the batch's mean outcome everywhere (what the learned critic of issue 22 predicts).
    * ``learned``: the trainer's own critic (no oracle); the walks then end at their first violation.
    """

    kind: str = "exact"
    sigma: float = 0.0
    mix: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in CRITIC_KINDS:
            raise ValueError(f"CriticError kind must be one of {CRITIC_KINDS}, got {self.kind!r}.")
        if not (math.isfinite(self.sigma) and self.sigma >= 0) or (self.sigma > 0) != (self.kind == "iid"):
            raise ValueError(
                f"`sigma` must be > 0 for kind 'iid' and 0 otherwise, got {self.sigma} ({self.kind})."
            )
        if not 0 <= self.mix <= 1 or (self.mix > 0) != (self.kind == "blind"):
            raise ValueError(f"`mix` must be in (0, 1] for kind 'blind' and 0 otherwise, got {self.mix}.")

    @property
    def name(self) -> str:
        """``exact``, ``iid0.25``, ``blind0.5``, ``stale``, ``constant``, ``learned``."""
        suffix = {"iid": self.sigma, "blind": self.mix}.get(self.kind)
        return self.kind if suffix is None else f"{self.kind}{suffix:g}"

    @classmethod
    def parse(cls, name: str) -> CriticError:
        """The inverse of :attr:`name`; a bare ``iid`` or ``blind`` is an error (the number is part of the arm)."""
        match = re.fullmatch(r"(iid|blind)([0-9.]+)", name)
        if match:
            key = "sigma" if match.group(1) == "iid" else "mix"
            return cls(match.group(1), **{key: float(match.group(2))})
        if name in ("iid", "blind"):
            raise ValueError(f"Critic {name!r} needs its number, e.g. iid0.25 or blind0.5.")
        return cls(name)


def walk_values(
    ahead: torch.Tensor,
    failed: torch.Tensor,
    valid: torch.Tensor,
    rate: float,
    error: CriticError = CriticError(),
    old_rate: float | None = None,
    mean_outcome: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The values ``(B, T)`` float32 of critic ``error`` from where each walk stands (pure torch).

    Args:
        ahead: ``(B, T)`` decisions at token ``t`` or later (``k_t``).
        failed: ``(B, T)`` True once the failing token is among tokens ``0 .. t-1``.
        valid: ``(B, T)`` the completion's tokens; values are 0 elsewhere.
        rate: the policy's per-decision success rate (``V* = rate ** k_t`` before a failure).
        error: the critic (kind ``learned`` has no oracle values: an error).
        old_rate: ``stale``'s earlier rate. mean_outcome: ``constant``'s value. generator: ``iid``'s noise.
    """
    position = torch.full(ahead.shape, float(rate), dtype=torch.float64) ** ahead
    exact = torch.where(failed, torch.zeros((), dtype=torch.float64), position)
    if error.kind == "exact":
        values = exact
    elif error.kind == "iid":
        if generator is None:
            raise ValueError("walk_values needs a `generator` for the iid critic.")
        # float32 noise added to the float32 values, as issue 22's sweep drew it (its runs reproduce).
        noise = torch.randn(ahead.shape, generator=generator) * error.sigma
        zero = torch.zeros((), dtype=torch.float64)
        return torch.where(valid, exact, zero).float() + torch.where(valid, noise, torch.zeros(()))
    elif error.kind == "blind":
        values = (1.0 - error.mix) * exact + error.mix * position
    elif error.kind == "stale":
        if old_rate is None:
            raise ValueError("walk_values needs `old_rate` for the stale critic.")
        old = torch.full(ahead.shape, float(old_rate), dtype=torch.float64) ** ahead
        values = torch.where(failed, torch.zeros((), dtype=torch.float64), old)
    elif error.kind == "constant":
        if mean_outcome is None:
            raise ValueError("walk_values needs `mean_outcome` for the constant critic.")
        values = torch.full(ahead.shape, float(mean_outcome), dtype=torch.float64)
    else:
        raise ValueError("The learned critic has no oracle values; the trainer's critic computes them.")
    return torch.where(valid, values, torch.zeros((), dtype=torch.float64)).float()


def scan_completions(
    tokenizer: Any, completion_ids: Sequence[Sequence[int]], problems: Sequence[dict[str, Any]]
) -> tuple[list[WalkScan], list[list[int]]]:
    """Each completion's :class:`WalkScan` and the character offset at which each of its tokens starts."""
    scans, starts = [], []
    for ids, p in zip(completion_ids, problems):
        starts.append(_token_starts(tokenizer, ids))
        text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
        scans.append(
            scan_walk(
                text, p["start"], p["tag"], p["doors"], int(p["num_decisions"]), int(p["filler_length"])
            )
        )
    return scans, starts


def walk_positions(
    scans: Sequence[WalkScan], starts: Sequence[Sequence[int]], problems: Sequence[dict[str, Any]], width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ahead, failed, valid)``, each ``(B, width)``, of scanned completions (see :func:`walk_values`)."""
    ahead = torch.zeros(len(scans), width, dtype=torch.long)
    failed = torch.zeros(len(scans), width, dtype=torch.bool)
    valid = torch.zeros(len(scans), width, dtype=torch.bool)
    for row, (scan, begin, problem) in enumerate(zip(scans, starts, problems)):
        if not begin:
            continue
        offsets = torch.tensor(begin, dtype=torch.long)
        decisions = torch.tensor(scan.decisions, dtype=torch.long)
        taken = (decisions[None, :] < offsets[:, None]).sum(dim=1)  # decisions before token t's text
        ahead[row, : len(begin)] = (int(problem["num_decisions"]) - taken).clamp_min(0)
        if scan.fail is not None:
            failed[row, : len(begin)] = offsets > scan.fail  # the failing character lies in tokens 0 .. t-1
        valid[row, : len(begin)] = True
    return ahead, failed, valid


def oracle_values(
    tokenizer: Any,
    completion_ids: Sequence[Sequence[int]],
    problems: Sequence[dict[str, Any]],
    width: int,
    sigma: float = 0.0,
    generator: torch.Generator | None = None,
    error: CriticError | None = None,
    old_rate: float | None = None,
    mean_outcome: float | None = None,
) -> tuple[torch.Tensor, float]:
    """The oracle critic's values of a batch (see the module docstring) and the batch's per-decision rate.

    Args:
        tokenizer: decodes each token to its text.
        completion_ids: per row, its valid completion tokens (EOS included), ``L_i`` of them.
        problems: per row, ``start``, ``tag``, ``doors``, ``num_decisions`` and ``filler_length``.
        width: ``T``, the padded width of the returned values.
        sigma: std of the zero-mean Gaussian noise added on valid positions (not clipped); shorthand for
            ``error=CriticError("iid", sigma)`` (``exact`` at 0).
        generator: the noise's generator (required when ``sigma > 0``).
        error, old_rate, mean_outcome: another critic error and what it needs (:func:`walk_values`).

    Returns:
        ``values`` ``(B, T)`` float32, 0 on positions ``t >= L_i``, and ``rate``.
    """
    if error is None:
        error = CriticError("iid", sigma=sigma) if sigma > 0 else CriticError()
    scans, starts = scan_completions(tokenizer, completion_ids, problems)
    rate = per_decision_success_rate(scans)
    ahead, failed, valid = walk_positions(scans, starts, problems, width)
    values = walk_values(ahead, failed, valid, rate, error, old_rate, mean_outcome, generator)
    return values, rate


_PROBLEM_KEYS = ("start", "tag", "doors", "num_decisions", "filler_length")


def batch_problems(batch: Any) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Each row's valid completion ids and its walk problem (from the batch's dataset columns)."""
    ids = [batch.completion_ids[i, : int(n)].tolist() for i, n in enumerate(batch.lengths.tolist())]
    problems = [{key: batch.columns[key][i] for key in _PROBLEM_KEYS} for i in range(len(ids))]
    return ids, problems


def end_walks_at_violation(batch: Any, tokenizer: Any) -> torch.Tensor:
    """Cut each completion after the token that holds its first failing character (in place; issue 30).

    The mask, ids, log-probs and entropies beyond the cut become padding, and a cut row counts as finished
    (not truncated): the walk ended at its failure, with reward 0 (an unfinished walk scores 0). Then the true
    value before any kept token is ``rate ** k_t``: a function of the position and the decisions done, which a
    critic can learn. Returns the new lengths.
    """
    ids, problems = batch_problems(batch)
    scans, starts = scan_completions(tokenizer, ids, problems)
    lengths = batch.lengths.clone()
    for row, (scan, begin) in enumerate(zip(scans, starts)):
        if scan.fail is None or not begin:
            continue
        cut = sum(1 for offset in begin if offset <= scan.fail)  # tokens 0 .. the failing one
        lengths[row] = cut
        batch.completion_mask[row, cut:] = 0
        batch.completion_ids[row, cut:] = tokenizer.pad_token_id
        for name in ("logprobs", "entropies", "sampler_logprobs"):
            tensor = getattr(batch, name)
            if tensor is not None:
                tensor[row, cut:] = 0.0
        batch.is_truncated[row] = False
    return lengths


def scale_to_unit_std(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Divide by the population std over the valid tokens, without centring (issue 30's scale fix).

    Every estimator then steps on the same scale against the NLL, while a zero advantage (every token of a
    failed walk whose value and return are 0) stays zero: centring, as full whitening does, turns those zeros
    positive and reinforces the text written after a failure (issue 22).
    """
    valid = advantages[mask].double()
    std = valid.std(unbiased=False) if valid.numel() > 1 else torch.zeros((), dtype=torch.float64)
    if std < 1e-8:
        return advantages
    return torch.where(mask, advantages / std.to(advantages.dtype), torch.zeros_like(advantages))


ADVANTAGE_SCALES = ("raw", "std")


class WalkRollouts(Rollouts):
    """The trainer's rollouts, each walk cut after its first failing character with ``end_at_violation``."""

    end_at_violation = False

    def sample(self, prompt_batch: dict[str, Any], recompute_logprobs: bool = True) -> Any:
        batch = super().sample(prompt_batch, recompute_logprobs)
        if self.end_at_violation:
            end_walks_at_violation(batch, self.processing_class)
        return batch


class WalkPPOTrainer(SAEPPOTrainer):
    """``SAEPPOTrainer`` on the walk task with a critic of chosen error (see :class:`CriticError`).

    Overrides, all within the trainer's phases: the rollout part (:class:`WalkRollouts`: with
    ``end_at_violation``, each walk cut after its first failing character), ``_compute_values`` (the oracle's values for every kind but ``learned``; the
    reference log-probs as the parent computes them; every step's per-decision success rate is kept in
    ``oracle_rates``), ``_compute_advantages`` (with ``advantage_scale="std"``, divided by their std) and
    ``_build_ppo_update`` (an oracle critic's :class:`OracleCriticUpdate` never runs nor trains it: no value
    forward, no value loss, so nothing but the EV metric reads the returns).

    Args:
        critic: a :class:`CriticError` or its name (``exact``, ``iid0.25``, ``blind0.5``, ``stale``, ...).
        sigma: shorthand for ``critic=CriticError("iid", sigma)`` (issue 22's arm); not with ``critic``.
        noise_seed: seeds the iid noise; step ``s`` draws from ``Generator().manual_seed(noise_seed * 100003 + s)``.
        end_at_violation: cut each walk after its first failing character (needed by a learned critic).
        advantage_scale: ``raw`` (as the estimator returns them) or ``std`` (needs ``whiten_advantages=False``).
        *args, **kwargs: ``SAEPPOTrainer``'s; the dataset must carry the walk task's columns.
    """

    def __init__(
        self,
        *args: Any,
        critic: CriticError | str | None = None,
        sigma: float | None = None,
        noise_seed: int = 0,
        end_at_violation: bool = False,
        advantage_scale: str = "raw",
        **kwargs: Any,
    ) -> None:
        if sigma is not None and critic is not None:
            raise ValueError("Pass `critic` or its shorthand `sigma`, not both.")
        if sigma is not None and not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"`sigma` must be a finite number >= 0, got {sigma}.")
        if sigma:
            critic = CriticError("iid", sigma=float(sigma))
        self.critic_error = CriticError.parse(critic) if isinstance(critic, str) else critic or CriticError()
        if advantage_scale not in ADVANTAGE_SCALES:
            raise ValueError(f"`advantage_scale` must be one of {ADVANTAGE_SCALES}, got {advantage_scale!r}.")
        self.noise_seed, self.end_at_violation, self.advantage_scale = (
            int(noise_seed),
            end_at_violation,
            advantage_scale,
        )
        self.oracle_rates: list[float] = []
        self.old_rate: float | None = None
        super().__init__(*args, **kwargs)
        if not self.args.uses_critic:
            raise ValueError(
                f"advantage_estimator={self.args.advantage_estimator!r} reads no critic; the oracle critic "
                "only makes sense for critic-based estimators (sae, gae, mc, adaptive_lambda)."
            )
        if advantage_scale == "std" and self.args.whiten_advantages:
            raise ValueError(
                "advantage_scale='std' rescales the raw advantages itself; set whiten_advantages=False in the config."
            )

    @property
    def uses_oracle(self) -> bool:
        return self.critic_error.kind != "learned"

    def _build_rollouts(self, cls: type[Rollouts] = WalkRollouts) -> Rollouts:
        rollouts = super()._build_rollouts(cls)
        rollouts.end_at_violation = self.end_at_violation
        return rollouts

    def _compute_values(self, batch: Any) -> None:
        ids, problems = batch_problems(batch)
        scans, starts = scan_completions(self.processing_class, ids, problems)
        rate = per_decision_success_rate(scans)
        self.oracle_rates.append(rate)
        if self.old_rate is None:
            self.old_rate = rate  # the first batch's: the warm start's policy
        if not self.uses_oracle:
            super()._compute_values(batch)
            return
        generator = torch.Generator().manual_seed(self.noise_seed * 100003 + self.state.global_step)
        ahead, failed, valid = walk_positions(scans, starts, problems, batch.completion_ids.shape[1])
        values = walk_values(
            ahead,
            failed,
            valid,
            rate,
            self.critic_error,
            old_rate=self.old_rate,
            mean_outcome=float(batch.scores.float().mean()),
            generator=generator,
        )
        batch.values = values.to(batch.logprobs.device, batch.logprobs.dtype)
        if self.args.kl_coef > 0:
            batch.ref_logprobs = self._reference_logprobs(batch)

    def _compute_advantages(self, batch: Any) -> None:
        super()._compute_advantages(batch)
        if self.advantage_scale == "std":
            batch.advantages = scale_to_unit_std(batch.advantages, batch.mask)

    def _build_ppo_update(self) -> PPOUpdate:
        update = OracleCriticUpdate if self.uses_oracle else PPOUpdate
        return update(self.accelerator, self.model, self.optimizer, self.args)


class OracleCriticUpdate(PPOUpdate):
    """The PPO update with an oracle critic: never run nor trained (no value forward, no value loss)."""

    def loss(
        self,
        batch: Any,
        index: torch.Tensor,
        train_actor: bool,
        with_critic: bool = True,
        denominator: Any = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return super().loss(batch, index, train_actor, with_critic=False, denominator=denominator)


def held_out_explained_variance(
    trainer: WalkPPOTrainer, test_set: Any, seed: int, num_walks: int = 64
) -> dict[str, float]:
    """The trainer's critic on held-out walks: EV of its values against the Monte-Carlo returns.

    ``num_walks`` (rounded up to whole groups of ``num_generations``) completions of the first held-out prompts,
    sampled by the trainer's own rollout (cut at the first violation when the trainer cuts) from a forked RNG
    seeded by ``seed``, so training draws nothing less or more. With ``gamma`` 1 and no KL the return of every
    token is the walk's outcome.
    """
    from critic_diagnosis import explained_variance

    prompts = trainer._prepare_prompt_dataset(test_set, "held-out EV")
    groups = min(len(prompts), -(-num_walks // trainer.args.num_generations))
    rows = [prompts[i] for i in range(groups)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        batch = trainer.rollouts.sample(trainer.rollouts.collate(rows))
    trainer.rollouts.score(batch)
    SAEPPOTrainer._compute_values(trainer, batch)
    returns = batch.scores[:, None].float().expand_as(batch.mask)
    return {
        "ev": explained_variance(batch.values.float(), returns, batch.mask),
        "walks": int(batch.mask.shape[0]),
        "success": float(batch.scores.float().mean()),
        "mean_length": float(batch.lengths.float().mean()),
    }


class WarmupCheck(TrainerCallback):
    """After the value warm-up's last step: the critic's held-out EV (:func:`held_out_explained_variance`)."""

    def __init__(self, trainer: WalkPPOTrainer, test_set: Any, seed: int, label: str) -> None:
        self.trainer, self.test_set, self.seed, self.label = trainer, test_set, seed, label
        self.result: dict[str, float] | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.value_warmup_steps and state.global_step == args.value_warmup_steps:
            self.result = held_out_explained_variance(self.trainer, self.test_set, self.seed)
            print(
                f"{self.label} after {state.global_step} warm-up steps: held-out critic EV {self.result['ev']:.3f} "
                f"({self.result['walks']} walks, {self.result['mean_length']:.0f} tokens)",
                flush=True,
            )


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------
# The pre-registered sweep of issue 30 (benchmarks/experiments/known-error-critic-issue30.md, "Pre-registration"):
# every critic arm x estimator x seed 0-11. Tuning and pilots use seeds 100-103 only.
CRITICS = ("exact", "iid0.25", "blind0.5", "blind1", "stale", "learned")
PRIMARY_CRITICS = ("blind0.5", "blind1", "stale", "learned")  # systematic error: where SAE should beat GAE
SWEEP_ESTIMATORS = ("sae", "gae", "mc")
COLLAPSED = 0.05  # a run whose final held-out success is at most this broke the walk


@dataclass
class Settings(lh.Settings):
    """The long-horizon settings plus the critic arms'; saved verbatim with the results."""

    critics: tuple[str, ...] = CRITICS
    noise_seed: int = 0
    # The scale fix (issue 30): "std" divides every estimator's advantages by their std (no centring).
    advantage_scale: str = "std"
    # The learned arm: critic-only steps first (its walks end at their first violation), and the held-out check.
    learned_warmup_steps: int = 8
    ev_threshold: float = 0.1


def default_settings() -> Settings:
    """The pre-registered settings (benchmarks/experiments/known-error-critic-issue30.md): filler 8, the
    long-horizon warm start."""
    return Settings(
        filler_lengths=(8,),
        estimators=SWEEP_ESTIMATORS,
        seeds=tuple(range(12)),
        steps=32,
        prompts_per_step=4,
        num_generations=8,
        learning_rate=3e-4,
        eval_every=8,
        eval_size=50,
        eval_samples=2,
        correlation=False,
        extra={"positive_nll_coef": PRE_REGISTERED_NLL, "whiten_advantages": False},
    )


def smoke_settings() -> Settings:
    """Every stage on tiny sizes (the long-horizon smoke's), three arms, two estimators. Not a result."""
    return Settings(
        **{
            **asdict(lh.smoke_settings()),
            "estimators": ("sae", "gae"),
            "filler_lengths": (2,),
            "correlation": False,
            "extra": {"whiten_advantages": False},
        },
        critics=("exact", "iid0.5", "learned"),
        learned_warmup_steps=1,
    )


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------
@dataclass
class Arm:
    """How one critic arm trains: its error, whether walks end at their first violation, its warm-up."""

    critic: CriticError
    end_at_violation: bool
    warmup_steps: int

    @classmethod
    def of(cls, name: str, settings: Settings) -> Arm:
        critic = CriticError.parse(name)
        learned = critic.kind == "learned"
        return cls(critic, learned, settings.learned_warmup_steps if learned else 0)


def run_one(
    estimator: str, seed: int, critic: str, settings: Settings, start: lh.WalkStart
) -> dict[str, Any]:
    """Train one estimator with one critic arm; returns the run's JSON payload (result, rates, warm-up check).

    The learned arm trains ``steps`` actor steps after its ``learned_warmup_steps`` critic-only steps.
    """

    arm = Arm.of(critic, settings)
    test_set = start.test_set(settings)
    fields = sweep.ppo_fields(
        settings,
        start.scratch / f"{critic}-{estimator}-seed{seed}",
        seed,
        max_steps=settings.steps + arm.warmup_steps,
        response_length=settings.response_length(start.filler_length),
        value_warmup_steps=arm.warmup_steps,
    )
    fields.update(advantage_estimator=estimator, **settings.extra)
    trainer = WalkPPOTrainer(
        **start.trainer_inputs(fields),
        critic=arm.critic,
        noise_seed=settings.noise_seed * 1000 + seed,
        end_at_violation=arm.end_at_violation,
        advantage_scale=settings.advantage_scale,
    )
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    label = f"[{critic} {estimator} seed {seed}]"
    warm_eval = start.warm["eval"]
    evaluator = lh.HeldOutEvaluation(unwrapped.policy, start.tokenizer, test_set, settings, label, warm_eval)
    check = WarmupCheck(
        trainer, test_set.remove_columns(["solution", "solution_is_correct"]), settings.eval_seed, label
    )
    times = sweep.train(trainer, evaluator, check)
    train = sweep.train_metrics(trainer, TRAIN_KEYS)
    result = start.result(estimator, seed, evaluator, train, times, warmup_steps=arm.warmup_steps)
    return {
        "settings": asdict(settings),
        "critic": critic,
        "result": asdict(result),
        "oracle_rates": list(trainer.oracle_rates[arm.warmup_steps :]),
        "warmup_check": check.result,
    }


def run_path(output_dir: Path, settings: Settings, critic: str, estimator: str, seed: int) -> Path:
    """Where one finished run is kept (a rerun of the sweep skips it)."""
    digest = lh.run_settings_fingerprint(replace(settings, critics=()))
    return output_dir / "runs" / f"{critic}-{estimator}-seed{seed}-{digest}.json"


# --------------------------------------------------------------------------------------------------
# The pre-registered analysis
# --------------------------------------------------------------------------------------------------
def _final(payload: dict[str, Any]) -> float:
    return float(payload["result"]["eval_success"][-1])


def _rate_last4(payload: dict[str, Any]) -> float:
    return float(np.mean(payload["oracle_rates"][-4:]))


def compare(mine: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], outcome: str) -> dict[str, Any]:
    """One pre-registered test of sae's runs against another estimator's (seeds are the units, unpaired).

    ``final_success`` / ``rate_last4``: two-sided Mann-Whitney U (exact without ties); ``collapse``: two-sided
    Fisher exact test of the collapsed counts; ``success_if_intact``: Mann-Whitney on the runs that did not
    collapse. The effect is sae's median minus the other's (collapse: sae's rate minus the other's).
    """
    from scipy import stats

    if outcome == "collapse":
        a = sum(_final(r) <= COLLAPSED for r in mine)
        b = sum(_final(r) <= COLLAPSED for r in other)
        table = [[a, len(mine) - a], [b, len(other) - b]]
        p = float(stats.fisher_exact(table).pvalue) if mine and other else math.nan
        return {
            "test": "fisher",
            "effect": a / max(len(mine), 1) - b / max(len(other), 1),
            "p": p,
            "n": [len(mine), len(other)],
        }
    pick = _rate_last4 if outcome == "rate_last4" else _final
    keep = (lambda r: _final(r) > COLLAPSED) if outcome == "success_if_intact" else (lambda r: True)
    x = [pick(r) for r in mine if keep(r)]
    y = [pick(r) for r in other if keep(r)]
    if len(x) < 2 or len(y) < 2:
        return {"test": "mannwhitney", "effect": math.nan, "p": math.nan, "n": [len(x), len(y)]}
    test = stats.mannwhitneyu(x, y, alternative="two-sided")
    return {
        "test": "mannwhitney",
        "effect": float(np.median(x) - np.median(y)),
        "U": float(test.statistic),
        "p": float(test.pvalue),
        "n": [len(x), len(y)],
    }


def preregistered_tests(
    by_cell: dict[tuple[str, str], list[dict[str, Any]]], critics: Sequence[str]
) -> list[dict[str, Any]]:
    """Every pre-registered test, Holm-adjusted within its family (benchmarks/experiments/known-error-critic-issue30.md,
    "Pre-registration").

    Primary: sae vs gae, final success, in each systematic-error arm present. Secondary: everything else
    (sae vs gae in the other arms and outcomes; sae vs mc in every arm and outcome).
    """
    tests = []
    for critic in critics:
        sae = by_cell.get((critic, "sae"), [])
        for versus in ("gae", "mc"):
            other = by_cell.get((critic, versus), [])
            if not sae or not other:
                continue
            for outcome in ("final_success", "collapse", "success_if_intact", "rate_last4"):
                primary = versus == "gae" and outcome == "final_success" and critic in PRIMARY_CRITICS
                tests.append(
                    {
                        "family": "primary" if primary else "secondary",
                        "critic": critic,
                        "versus": versus,
                        "outcome": outcome,
                        **compare(sae, other, outcome),
                    }
                )
    for family in ("primary", "secondary"):
        members = [t for t in tests if t["family"] == family and not math.isnan(t["p"])]
        for test, adjusted in zip(members, common.holm([t["p"] for t in members])):
            test["p_holm"] = adjusted
    return tests


def summarise(
    by_cell: dict[tuple[str, str], list[dict[str, Any]]], settings: Settings
) -> list[dict[str, Any]]:
    """Per critic arm and estimator: final success (per seed, mean, collapsed, among the intact), AUC,
    per-decision rate of the last 4 steps, advantage scale, EV (training; held-out after the warm-up)."""
    rows = []
    for critic in settings.critics:
        for estimator in settings.estimators:
            runs = by_cell.get((critic, estimator), [])
            if not runs:
                continue
            finals = [_final(r) for r in runs]
            intact = [v for v in finals if v > COLLAPSED]
            checks = [r["warmup_check"]["ev"] for r in runs if r.get("warmup_check")]
            rows.append(
                {
                    "critic": critic,
                    "estimator": estimator,
                    "seeds": [r["result"]["seed"] for r in runs],
                    "final_success_per_seed": finals,
                    "final_success_mean": float(np.mean(finals)),
                    "final_success_median": float(np.median(finals)),
                    "collapsed": sum(v <= COLLAPSED for v in finals),
                    "success_if_intact_mean": float(np.mean(intact)) if intact else math.nan,
                    "auc_mean": float(
                        np.mean(
                            [
                                common.curve_auc(r["result"]["eval_steps"], r["result"]["eval_success"])
                                for r in runs
                            ]
                        )
                    ),
                    "rate_last4_mean": float(np.mean([_rate_last4(r) for r in runs])),
                    "advantage_std": float(
                        np.mean(
                            [np.nanmean(r["result"]["train"].get("advantages/std", [math.nan])) for r in runs]
                        )
                    ),
                    "train_ev_mean": float(
                        np.mean([np.nanmean(r["result"]["train"]["critic/explained_variance"]) for r in runs])
                    ),
                    "warmup_ev_per_seed": checks,
                    "warmup_ev_passed": sum(v > settings.ev_threshold for v in checks),
                    "seconds_per_run": float(np.mean([r["result"]["seconds"] for r in runs])),
                }
            )
    return rows


def markdown(results: dict[str, Any]) -> str:
    """The per-arm table and the pre-registered tests."""
    s = results["settings"]
    lines = [
        "# Critic errors of the right kind (issue 30): the pre-registered sweep",
        "",
        f"Filler {s['filler_lengths'][0]}, warm start {results['warm_success']:.3f} held-out success. Every run: "
        f"{s['steps']} actor steps x {s['prompts_per_step']} prompts x {s['num_generations']} generations, actor lr "
        f"{s['learning_rate']:g}, advantage scale `{s['advantage_scale']}`, extra {json.dumps(s['extra'])}; the "
        f"learned arm first {s['learned_warmup_steps']} critic-only steps, its walks ending at their first "
        f"violation. Collapsed: final success <= {COLLAPSED}.",
        "",
        "| critic | estimator | final success per seed | mean (median) | collapsed | mean if intact | AUC | "
        "rate, last 4 steps | advantage std | EV train | EV held-out after warm-up (> "
        f"{s['ev_threshold']:g}) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in results["summary"]:
        per_seed = ", ".join(f"{v:.2f}" for v in row["final_success_per_seed"])
        ev = (
            ", ".join(f"{v:.2f}" for v in row["warmup_ev_per_seed"]) + f" ({row['warmup_ev_passed']} pass)"
            if row["warmup_ev_per_seed"]
            else ""
        )
        lines.append(
            f"| {row['critic']} | {row['estimator']} | {per_seed} | {row['final_success_mean']:.3f} "
            f"({row['final_success_median']:.3f}) | {row['collapsed']}/{len(row['seeds'])} | "
            f"{row['success_if_intact_mean']:.3f} | {row['auc_mean']:.3f} | {row['rate_last4_mean']:.3f} | "
            f"{row['advantage_std']:.3f} | {row['train_ev_mean']:.3f} | {ev} |"
        )
    lines += [
        "",
        "Pre-registered tests, sae against the other (two-sided; Holm within each family; effect: difference of "
        "medians, or of collapse rates):",
        "",
        "| family | critic | versus | outcome | test | n | effect | p | p (Holm) |",
        "|---|---|---|---|---|---|---:|---:|---:|",
    ]
    for t in sorted(results["tests"], key=lambda t: (t["family"] != "primary", t["critic"], t["versus"])):
        lines.append(
            f"| {t['family']} | {t['critic']} | {t['versus']} | {t['outcome']} | {t['test']} | "
            f"{t['n'][0]} vs {t['n'][1]} | {t['effect']:+.3f} | {t['p']:.4f} | {t.get('p_holm', math.nan):.4f} |"
        )
    lines += ["", "![final success](final_success.png)", "", "![learning curves](learning_curves.png)", ""]
    lines += common.report_footer(results)
    return "\n".join(lines)


def plot(
    results: dict[str, Any], by_cell: dict[tuple[str, str], list[dict[str, Any]]], output_dir: Path
) -> None:
    """final_success.png (every run's final success per arm and estimator), learning_curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = results["settings"]
    critics, estimators = settings["critics"], settings["estimators"]
    figure, axis = plt.subplots(figsize=(2 + 1.6 * len(critics), 4), constrained_layout=True)
    width = 0.8 / len(estimators)
    for j, estimator in enumerate(estimators):
        for i, critic in enumerate(critics):
            finals = [_final(r) for r in by_cell.get((critic, estimator), [])]
            x = i + (j - (len(estimators) - 1) / 2) * width
            axis.scatter(
                [x] * len(finals),
                finals,
                s=14,
                color=common.COLOURS.get(estimator),
                alpha=0.7,
                label=estimator if i == 0 else None,
            )
            if finals:
                axis.plot([x - width / 3, x + width / 3], [np.median(finals)] * 2, color="black", lw=1.5)
    axis.axhline(results["warm_success"], color="grey", ls=":", label="warm start")
    axis.set_xticks(range(len(critics)), critics)
    axis.set_ylabel("final held-out success (one dot per seed; bar: median)")
    axis.grid(alpha=0.3, axis="y")
    axis.legend(fontsize=8)
    figure.savefig(output_dir / "final_success.png", dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(
        1, len(critics), figsize=(3.6 * len(critics), 3.4), constrained_layout=True, squeeze=False
    )
    for axis, critic in zip(axes[0], critics):
        for estimator in estimators:
            runs = by_cell.get((critic, estimator), [])
            if runs:
                curve = np.mean([r["result"]["eval_success"] for r in runs], axis=0)
                axis.plot(
                    runs[0]["result"]["eval_steps"],
                    curve,
                    marker="o",
                    label=estimator,
                    color=common.COLOURS.get(estimator),
                )
        axis.set_title(f"{critic}: held-out success (mean of seeds)", fontsize=9)
        axis.set_xlabel("actor step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(output_dir / "learning_curves.png", dpi=100)
    plt.close(figure)


def mannwhitney_power(
    collapse: tuple[float, float], shift: float, n: int, alpha: float, sims: int = 2000, seed: int = 0
) -> float:
    """Simulated power of the primary test (two-sided Mann-Whitney U, ``n`` vs ``n`` runs) under the bimodal
    outcome the issue-22 sweep measured: a run collapses (final success ~U(0, 0.05)) with probability
    ``collapse[i]``, else ends at ~N(0.65, 0.15) clipped to [0.06, 1] (the intact runs' spread there), the first
    estimator's intact runs higher by ``shift``."""
    from scipy import stats

    rng = np.random.default_rng(seed)

    def draw(p: float, mean: float) -> np.ndarray:
        intact = np.clip(rng.normal(mean, 0.15, n), 0.06, 1.0)
        return np.where(rng.random(n) < p, rng.uniform(0, COLLAPSED, n), intact)

    rejected = sum(
        stats.mannwhitneyu(draw(collapse[0], 0.65 + shift), draw(collapse[1], 0.65)).pvalue <= alpha
        for _ in range(sims)
    )
    return rejected / sims


def power_table(n: int = 12, alpha: float = 0.05, family: int = len(PRIMARY_CRITICS)) -> list[dict[str, Any]]:
    """The pre-registration's resolvable effects at ``n`` vs ``n`` runs, at ``alpha`` and at Holm's strictest
    level ``alpha / family``: Fisher's exact power for collapse rates, simulated Mann-Whitney power for the
    primary outcome (collapse rates and a shift of the intact runs)."""
    rows: list[dict[str, Any]] = []
    for p1, p2 in [(0.1, 0.5), (0.1, 0.6), (0.1, 0.7), (0.0, 0.5), (0.2, 0.8), (0.25, 0.75)]:
        rows.append(
            {
                "test": "fisher (collapse)",
                "effect": f"collapse {p1:g} vs {p2:g}",
                "power": common.fisher_power(p1, p2, n, alpha),
                "power_strict": common.fisher_power(p1, p2, n, alpha / family),
            }
        )
    for collapse, shift in [
        ((0.1, 0.5), 0.0),
        ((0.1, 0.6), 0.0),
        ((0.0, 0.0), 0.2),
        ((0.0, 0.0), 0.3),
        ((0.1, 0.4), 0.1),
        ((0.2, 0.2), 0.3),
    ]:
        rows.append(
            {
                "test": "mannwhitney (final success)",
                "effect": f"collapse {collapse[0]:g} vs {collapse[1]:g}, intact shift {shift:+g}",
                "power": mannwhitney_power(collapse, shift, n, alpha),
                "power_strict": mannwhitney_power(collapse, shift, n, alpha / family),
            }
        )
    return rows


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps_help = "actor steps (the learned arm adds its warm-up)"
    sweep.add_sweep_arguments(parser, DEFAULT_OUTPUT_DIR, ESTIMATORS, "sae gae mc;0-11", steps_help)
    parser.add_argument(
        "--critics",
        nargs="+",
        default=None,
        help="critic arms: exact, iidSIGMA, blindMIX, stale, constant, learned (default: the pre-registered six)",
    )
    parser.add_argument("--advantage-scale", choices=ADVANTAGE_SCALES, default=None, help="default: std")
    parser.add_argument("--learned-warmup-steps", type=int, default=None)
    parser.add_argument("--eval-size", type=int, default=None)
    parser.add_argument("--eval-samples", type=int, default=None)
    parser.add_argument(
        "--extra",
        type=json.loads,
        default=None,
        help="other SAEPPOConfig fields as JSON, replacing the default extra (e.g. '{\"positive_nll_coef\": 16}')",
    )
    parser.add_argument(
        "--power", action="store_true", help="print the pre-registration's power table and exit"
    )
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    flags = ("critics", "advantage_scale", "learned_warmup_steps", "eval_size", "eval_samples", "extra")
    settings = sweep.apply_overrides(smoke_settings() if args.smoke else default_settings(), args, *flags)
    for name in settings.critics:
        try:
            CriticError.parse(name)
        except ValueError as error:
            raise SystemExit(f"--critics: {error}") from None
    if settings.learned_warmup_steps < 1:
        raise SystemExit("--learned-warmup-steps must be >= 1.")
    if settings.advantage_scale == "std" and settings.extra.get("whiten_advantages", True):
        raise SystemExit("--advantage-scale std needs whiten_advantages false in --extra.")
    return settings


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweep and write its outputs; returns the results dictionary (also saved as JSON).

    With ``--power`` only the power table is printed (nothing is written).
    """
    if parse_args(argv).power:
        table = power_table()
        for row in table:
            print(json.dumps(row), flush=True)
        return {"power": table}
    return common.run_script(argv, _SCRIPT, parse_args, settings_from_args, run_sweep)


def run_sweep(settings: Settings, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Warm start, then every (seed, critic, estimator) run through the resumable runner; summary, tests, figures."""
    output_dir: Path = args.output_dir
    f = settings.filler_lengths[0]
    with sweep.session(args, command, "known_error_critic_") as session:
        start = lh.warm_start_and_evaluate(settings, f, session)
        warm = start.warm
        # Seed-major: an interrupted sweep holds whole seeds of every (critic, estimator) cell.
        cells = [(c, e, s) for s in settings.seeds for c in settings.critics for e in settings.estimators]
        jobs = [
            common.Job(
                f"{critic} {estimator} seed {seed}",
                run_path(output_dir, settings, critic, estimator, seed),
                partial(run_one, estimator, seed, critic, settings, start),
            )
            for critic, estimator, seed in cells
        ]
        payloads = common.run_jobs(jobs, commit=args.commit)

    by_cell: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (critic, estimator, _), payload in zip(cells, payloads):
        by_cell.setdefault((critic, estimator), []).append(payload)
    results = {
        "command": command,
        "environment": session.env,
        "settings": asdict(settings),
        "warm_start": {k: v for k, v in warm.items() if k != "eval"},
        "warm_success": warm["eval"]["success"],
        "summary": summarise(by_cell, settings),
        "tests": preregistered_tests(by_cell, settings.critics),
        "runs": [
            {"critic": c, **p["result"], "oracle_rates": p["oracle_rates"], "warmup_check": p["warmup_check"]}
            for (c, _, _), p in zip(cells, payloads)
        ],
        "total_seconds": session.seconds(),
    }
    plot(results, by_cell, output_dir)
    print(markdown(results), flush=True)
    sweep.finish_sweep(output_dir, results, markdown(results))
    return results


if __name__ == "__main__":
    main()
