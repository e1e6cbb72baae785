"""A critic of known error on the walk task: does SAE beat GAE when the critic is wrong, and lose when it is right?

Issue 22, part 2. The learned critic of the long-horizon testbed learns nothing (``critic_diagnosis.py``), so
every critic-based estimator there bootstraps on a constant. Here the critic is replaced by an *oracle* whose
error is chosen: the walk task's true success probability plus zero-mean Gaussian noise of std ``sigma``
(:class:`OracleCriticPPOTrainer`, which overrides the trainer's ``_compute_values`` phase). With the rest of
the long-horizon benchmark unchanged (warm start, held-out evaluation, paired statistics), every estimator x
sigma x seed is trained from the same warm start, and the Section 5.3.2 correlation with Monte-Carlo ``A*`` is
measured at each sigma on the warm-start policy.

The oracle value (index convention of docs/design.md: ``values[t]`` is the value of the state *before*
completion token ``t``):

* A completion **fails** at the first character that no correct walk can have there (:func:`scan_walk`: the
  exact text of :func:`trl_sae.demo.decision_task.format_walk` with any allowed door at each decision; only
  whitespace may follow the final ``END <room>``). ``values[t] = 0`` once the failing token is among tokens
  ``0 .. t-1``.
* Otherwise ``values[t] = rate ** k_t``: ``k_t`` decisions are still ahead (decision doors at token ``t`` or
  later), and ``rate`` is the **per-decision success rate measured from the batch**: among the decision doors
  of this batch's completions that were reached with a still-correct prefix, the fraction that were allowed
  (:func:`per_decision_success_rate`). The deterministic stretches are treated as certain (the warm start
  copies them with probability ~1 at T = 0.6; see the README's measurements).
* Noise: ``N(0, sigma^2)`` per (row, position), drawn from a generator seeded by ``(noise_seed, step)``, added
  on valid positions only, **not clipped** (clipping to [0, 1] would bias the noise near 0 and 1, i.e. on
  every failed walk's tail and every finished one).

The oracle needs no critic forward pass and no critic training: :class:`OracleCriticPPOTrainer` also runs its
PPO loss without the critic (``_ppo_loss(..., with_critic=False)``), so the critic model the trainer builds is
never called nor updated, and the returns are read by nothing but the ``critic/explained_variance`` metric
(then the oracle's EV against the Monte-Carlo returns).

Outputs (``--output-dir``, default ``benchmarks/results/known_error_critic/``): ``results.json`` (settings,
per-seed curves, summaries, correlations), ``results.md`` (tables), ``runs/*.json`` (one per run, reused by an
interrupted sweep), ``success_vs_sigma.png``, ``paired_sae_minus_gae.png``, ``learning_curves.png``,
``correlation_vs_sigma.png``, ``command.txt``, ``run.log``.

``python benchmarks/known_error_critic.py --smoke`` runs every stage on tiny sizes in seconds (not a result).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import long_horizon as lh
import sample_efficiency as se

from trl_sae import SAEPPOTrainer
from trl_sae.demo.decision_task import filler

ESTIMATORS = ("sae", "gae", "mc", "adaptive_lambda")
SIGMAS = (0.0, 0.1, 0.25, 0.5)
_SCRIPT = "benchmarks/known_error_critic.py"
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results" / "known_error_critic"
_PROMPT = re.compile(r"Walk (\d+) from ([a-z]) pass (\d+)")
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


def oracle_values(
    tokenizer: Any,
    completion_ids: Sequence[Sequence[int]],
    problems: Sequence[dict[str, Any]],
    width: int,
    sigma: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, float]:
    """The oracle critic's values of a batch (see the module docstring) and the batch's per-decision rate.

    Args:
        tokenizer: decodes each token to its text.
        completion_ids: per row, its valid completion tokens (EOS included), ``L_i`` of them.
        problems: per row, ``start``, ``tag``, ``doors``, ``num_decisions`` and ``filler_length``.
        width: ``T``, the padded width of the returned values.
        sigma: std of the zero-mean Gaussian noise added on valid positions (not clipped).
        generator: the noise's generator (required when ``sigma > 0``).

    Returns:
        ``values`` ``(B, T)`` float32, 0 on positions ``t >= L_i``, and ``rate``.
    """
    texts, starts = [], []
    for ids in completion_ids:
        starts.append(_token_starts(tokenizer, ids))
        texts.append(tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))
    scans = [
        scan_walk(
            text,
            p["start"],
            p["tag"],
            p["doors"],
            int(p["num_decisions"]),
            int(p["filler_length"]),
        )
        for text, p in zip(texts, problems)
    ]
    rate = per_decision_success_rate(scans)
    values = torch.zeros(len(completion_ids), width)
    for row, (scan, begin, problem) in enumerate(zip(scans, starts, problems)):
        if not begin:
            continue
        offsets = torch.tensor(begin, dtype=torch.long)
        decisions = torch.tensor(scan.decisions, dtype=torch.long)
        taken = (decisions[None, :] < offsets[:, None]).sum(dim=1)  # decisions before token t's text
        ahead = (int(problem["num_decisions"]) - taken).clamp_min(0)
        row_values = torch.full((len(begin),), rate, dtype=torch.float64) ** ahead
        if scan.fail is not None:
            row_values[offsets > scan.fail] = 0.0  # the failing character lies in tokens 0 .. t-1
        values[row, : len(begin)] = row_values.float()
    if sigma > 0:
        if generator is None:
            raise ValueError("oracle_values needs a `generator` when sigma > 0.")
        noise = torch.randn(values.shape, generator=generator) * sigma
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        valid = torch.arange(width)[None, :] < lengths[:, None]
        values = values + torch.where(valid, noise, torch.zeros(()))
    return values, rate


def _problem_from_prompt(text: str, doors: str, filler_length: int) -> dict[str, Any]:
    match = _PROMPT.search(text)
    if match is None:
        raise ValueError(f"No walk request (`Walk <n> from <room> pass <tag>`) in the prompt {text!r}.")
    return {
        "num_decisions": int(match.group(1)),
        "start": match.group(2),
        "tag": match.group(3),
        "doors": doors,
        "filler_length": filler_length,
    }


def oracle_value_fn(tokenizer: Any, doors: str, filler_length: int, sigma: float, noise_seed: int) -> Any:
    """The oracle as a Section 5.3.2 ``value_fn(sequences (B, P+T), attention_mask, P) -> (B, T)``.

    The problem (start room, pass number, decisions) is read from each prompt's text; the rate is measured
    from the batch given; the noise generator is seeded once with ``noise_seed`` (deterministic per call order).
    """
    generator = torch.Generator().manual_seed(noise_seed)

    def value_fn(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        mask = attention_mask[:, prompt_length:].bool().cpu()
        problems, ids = [], []
        for row in range(sequences.shape[0]):
            prompt = sequences[row, :prompt_length][attention_mask[row, :prompt_length].bool()]
            problems.append(_problem_from_prompt(tokenizer.decode(prompt.tolist()), doors, filler_length))
            ids.append(sequences[row, prompt_length:].cpu()[mask[row]].tolist())
        values, _ = oracle_values(tokenizer, ids, problems, mask.shape[1], sigma, generator)
        return values.to(sequences.device)

    return value_fn


class OracleCriticPPOTrainer(SAEPPOTrainer):
    """``SAEPPOTrainer`` whose critic is the walk task's oracle plus noise (see the module docstring).

    Overrides two phases: ``_compute_values`` (the oracle instead of the critic's forward; the reference
    log-probs as the parent computes them) and ``_ppo_loss`` (never the critic: no value forward, no value
    loss, so the built critic's weights stay as built and nothing but the EV metric reads the returns).

    Args:
        sigma: std of the values' noise.
        noise_seed: seeds the noise; step ``s`` draws from ``Generator().manual_seed(noise_seed * 100003 + s)``.
        *args, **kwargs: ``SAEPPOTrainer``'s; the dataset must carry the walk task's columns.
    """

    def __init__(self, *args: Any, sigma: float = 0.0, noise_seed: int = 0, **kwargs: Any) -> None:
        if sigma < 0 or not math.isfinite(sigma):
            raise ValueError(f"`sigma` must be a finite number >= 0, got {sigma}.")
        self.sigma, self.noise_seed = float(sigma), int(noise_seed)
        self.oracle_rates: list[float] = []
        super().__init__(*args, **kwargs)
        if not self.args.uses_critic:
            raise ValueError(
                f"advantage_estimator={self.args.advantage_estimator!r} reads no critic; the oracle critic "
                "only makes sense for critic-based estimators (sae, gae, mc, adaptive_lambda)."
            )

    def _compute_values(self, batch: Any) -> None:
        lengths = batch.lengths.tolist()
        ids = [batch.completion_ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]
        problems = [
            {
                key: batch.columns[key][i]
                for key in ("start", "tag", "doors", "num_decisions", "filler_length")
            }
            for i in range(len(ids))
        ]
        generator = torch.Generator().manual_seed(self.noise_seed * 100003 + self.state.global_step)
        values, rate = oracle_values(
            self.processing_class, ids, problems, batch.completion_ids.shape[1], self.sigma, generator
        )
        self.oracle_rates.append(rate)
        batch.values = values.to(batch.logprobs.device, batch.logprobs.dtype)
        if self.args.kl_coef > 0:
            batch.ref_logprobs = self._reference_logprobs(batch)

    def _ppo_loss(
        self,
        batch: Any,
        index: torch.Tensor,
        train_actor: bool,
        with_critic: bool = True,
        denominator: Any = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return super()._ppo_loss(batch, index, train_actor, with_critic=False, denominator=denominator)


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------
@dataclass
class Settings(lh.Settings):
    """The long-horizon settings plus the oracle's; saved verbatim with the results."""

    sigmas: tuple[float, ...] = SIGMAS
    noise_seed: int = 0


def default_settings() -> Settings:
    """Filler 8 on the long-horizon warm start, sized for ~75 min of one thread (see benchmarks/README.md)."""
    return Settings(
        filler_lengths=(8,),
        estimators=ESTIMATORS,
        seeds=(0, 1, 2, 3),
        steps=16,
        prompts_per_step=4,
        num_generations=8,
        learning_rate=1e-4,
        eval_every=8,
        eval_size=50,
        eval_samples=2,
        corr_trajectories=32,
        corr_spans=2,
        corr_continuations=8,
        corr_bootstrap=500,
    )


def smoke_settings() -> Settings:
    """Every stage on tiny sizes (the long-horizon smoke's), two sigmas, two estimators. Not a result."""
    return Settings(
        **{**asdict(lh.smoke_settings()), "estimators": ("sae", "gae"), "filler_lengths": (2,)},
        sigmas=(0.0, 0.5),
    )


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------
def run_one(
    estimator: str,
    seed: int,
    sigma: float,
    settings: Settings,
    warm_dir: Path,
    splits: Any,
    tokenizer: Any,
    warm_eval: dict[str, Any],
    scratch: Path,
) -> tuple[lh.RunResult, list[float]]:
    """Train one estimator with the oracle critic at ``sigma``; returns its result and the per-step rates."""
    from transformers import AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback

    from trl_sae import SAEPPOConfig
    from trl_sae.demo.decision_task import walk_reward

    f = settings.filler_lengths[0]
    test_set = splits["test"].select(range(min(settings.eval_size, len(splits["test"]))))
    train_set = splits["train"].remove_columns(["solution", "solution_is_correct"])
    fields: dict[str, Any] = {
        "output_dir": str(scratch / f"s{sigma}-{estimator}-seed{seed}"),
        "per_device_train_batch_size": settings.batch_size,
        "num_generations": settings.num_generations,
        "max_steps": settings.steps,
        "response_length": settings.response_length(f),
        "temperature": settings.temperature,
        "learning_rate": settings.learning_rate,
        "critic_learning_rate": settings.critic_learning_rate,
        "lr_scheduler_type": "constant",
        "num_ppo_epochs": settings.num_ppo_epochs,
        "num_mini_batches": settings.num_mini_batches,
        "segment_threshold": settings.segment_threshold,
        "lam": settings.lam,
        "seed": seed,
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "use_cpu": True,
        "advantage_estimator": estimator,
        **settings.extra,
    }
    trainer = OracleCriticPPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(warm_dir),
        reward_funcs=walk_reward,
        args=SAEPPOConfig(**fields),
        train_dataset=train_set,
        processing_class=tokenizer,
        sigma=sigma,
        noise_seed=settings.noise_seed * 1000 + seed,
    )
    trainer.remove_callback(PrinterCallback)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    label = f"[sigma={sigma:g} {estimator} seed {seed}]"
    evaluator = lh.HeldOutEvaluation(unwrapped.policy, tokenizer, test_set, settings, label, warm_eval)
    trainer.add_callback(evaluator)
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    logs = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    train = {key: [float(entry.get(key, math.nan)) for entry in logs] for key in TRAIN_KEYS}
    result = lh.RunResult(
        f,
        estimator,
        seed,
        evaluator.steps,
        evaluator.success,
        {str(p): v for p, v in evaluator.last["by_p"].items()},
        train,
        seconds,
        cpu_seconds,
    )
    return result, list(trainer.oracle_rates)


def run_path(output_dir: Path, settings: Settings, sigma: float, estimator: str, seed: int) -> Path:
    """Where one finished run is kept (an interrupted sweep resumes at the first missing run)."""
    digest = lh.run_settings_fingerprint(replace(settings, sigmas=()))
    return output_dir / "runs" / f"sigma{sigma:g}-{estimator}-seed{seed}-{digest}.json"


# --------------------------------------------------------------------------------------------------
# Correlation with A* at each sigma (Section 5.3.2) on the warm-start policy
# --------------------------------------------------------------------------------------------------
def correlation_at(
    policy: Any, tokenizer: Any, splits: Any, settings: Settings, sigma: float
) -> dict[str, Any]:
    """Pearson r of every estimator with Monte-Carlo ``A*``, values from the oracle at ``sigma``.

    The same seed for every sigma: the same trajectories, spans and ``A*``; only the values' noise differs.
    """
    from trl_sae.analysis import correlate_advantages
    from trl_sae.demo.decision_task import walk_reward

    f = settings.filler_lengths[0]
    doors = splits["test"][0]["doors"]
    start = time.perf_counter()
    result = correlate_advantages(
        policy,
        tokenizer,
        splits["test"],
        walk_reward,
        oracle_value_fn(tokenizer, doors, f, sigma, noise_seed=settings.noise_seed),
        num_trajectories=settings.corr_trajectories,
        num_spans_per_trajectory=settings.corr_spans,
        num_continuations=settings.corr_continuations,
        temperature=settings.temperature,
        max_new_tokens=settings.response_length(f),
        lam_grid=(0.95, 1.0),
        p_grid=(settings.segment_threshold,),
        sae_lam=settings.lam,
        seed=0,
        batch_size=128,
        span_p=settings.segment_threshold,
        num_bootstrap=settings.corr_bootstrap,
        show_progress=False,
    )
    rows = {
        _estimator_of(row.estimator, row.setting): {
            "r": row.pearson,
            "ci": [row.ci_low, row.ci_high],
            "n_tokens": row.n_tokens,
            "n_spans": row.n_spans,
        }
        for row in result.rows
    }
    return {"sigma": sigma, "rows": rows, "seconds": time.perf_counter() - start}


def _estimator_of(estimator: str, setting: str) -> str:
    """The sweep's estimator name of a Section 5.3.2 row (GAE lam 1 is ``mc``)."""
    if estimator == "gae":
        return "mc" if setting.endswith("=1") else "gae"
    return estimator


# --------------------------------------------------------------------------------------------------
# Summaries and figures
# --------------------------------------------------------------------------------------------------
def summarise_sigma(
    runs: Sequence[lh.RunResult], rates: dict[str, list[float]], settings: Settings, sigma: float
) -> dict[str, Any]:
    """The long-horizon summary (per estimator; sae minus each other, paired by seed) of one sigma's runs, plus
    the oracle's EV and the per-decision success rate of the training batches (first and last 4 steps).

    The rate is measured on ~256 decisions per step, so it shows learning that 100 held-out samples cannot.
    """
    summary = lh.summarise(runs, settings, settings.filler_lengths[0], threshold=math.inf)
    summary["sigma"] = sigma

    def step_rates(run: lh.RunResult) -> list[float]:
        return rates[f"sigma{sigma:g}-{run.estimator}-seed{run.seed}"]

    for row in summary["rows"]:
        mine = [r for r in runs if r.estimator == row["estimator"]]
        row["oracle_ev_mean"] = float(
            np.mean([np.nanmean(r.train["critic/explained_variance"]) for r in mine])
        )
        row["decision_rate_first4"] = float(np.mean([np.mean(step_rates(r)[:4]) for r in mine]))
        late = [float(np.mean(step_rates(r)[-4:])) for r in mine]
        row["decision_rate_last4"] = float(np.mean(late))
        row["decision_rate_last4_std"] = float(np.std(late, ddof=1)) if len(late) > 1 else 0.0
        # Mean over steps and seeds of the raw (pre-whitening) advantages' std and mean over valid tokens.
        for key in ("std", "mean"):
            row[f"advantage_{key}"] = float(
                np.mean([np.nanmean(r.train.get(f"advantages/{key}", [math.nan])) for r in mine])
            )
    sae = {r.seed: r for r in runs if r.estimator == "sae"}
    for estimator in settings.estimators:
        other = {r.seed: r for r in runs if r.estimator == estimator}
        seeds = sorted(set(sae) & set(other))
        if estimator == "sae" or not seeds:
            continue
        stats = common.paired_difference(
            [float(np.mean(step_rates(sae[s])[-4:])) for s in seeds],
            [float(np.mean(step_rates(other[s])[-4:])) for s in seeds],
            settings.bootstrap,
            seed=0,
        )
        summary["paired"].append(
            {"versus": estimator, "metric": "decision_rate_last4", "seeds": seeds, **stats}
        )
    return summary


def markdown(results: dict[str, Any]) -> str:
    """Tables: per sigma (final success, AUC, boundaries, paired sae - other), correlation with A* vs sigma."""
    s = results["settings"]
    n = len(s["seeds"])
    lines = [
        "# A critic of known error: the oracle plus noise (issue 22, part 2)",
        "",
        f"Filler {s['filler_lengths'][0]}, {s['num_decisions']} decisions, warm start {s['sft_steps']} SFT steps. "
        f"Every run: {s['steps']} PPO steps x {s['prompts_per_step']} prompts x {s['num_generations']} generations "
        f"= {results['samples_per_run']} completions, actor lr {s['learning_rate']:g}, T = {s['temperature']:g}, "
        f"{s['num_ppo_epochs']} PPO epochs x {s['num_mini_batches']} mini-batches, SAE p = {s['segment_threshold']:g}, "
        f"lam = {s['lam']:g}; no critic training (oracle). Held-out success: {s['eval_size']} prompts x "
        f"{s['eval_samples']} samples every {s['eval_every']} steps; warm start {results['warm_success']:.3f}. "
        f"{n} seeds.",
        "",
        "| sigma | estimator | final success (mean ± std) | AUC (mean ± std) | per-decision rate, first 4 -> "
        "last 4 steps | boundaries / completion | oracle EV | advantage std (mean) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for summary in results["summaries"]:
        for row in summary["rows"]:
            lines.append(
                f"| {summary['sigma']:g} | {row['estimator']} | {row['final_success_mean']:.3f} ± "
                f"{row['final_success_std']:.3f} | {row['auc_mean']:.3f} ± {row['auc_std']:.3f} | "
                f"{row['decision_rate_first4']:.3f} -> {row['decision_rate_last4']:.3f} ± "
                f"{row['decision_rate_last4_std']:.3f} | "
                f"{row['train_boundaries_per_completion']:.1f} | {row['oracle_ev_mean']:.3f} | "
                f"{row['advantage_std']:.3f} ({row['advantage_mean']:+.3f}) |"
            )
    lines += [
        "",
        "Paired over seeds, sae minus the other (mean; t 95% interval; bootstrap 95% interval):",
        "",
        "| sigma | versus | metric | mean | t interval | bootstrap interval |",
        "|---:|---|---|---:|---|---|",
    ]
    for summary in results["summaries"]:
        for p in summary["paired"]:
            lines.append(
                f"| {summary['sigma']:g} | {p['versus']} | {p['metric']} | {p['mean']:+.3f} | "
                f"[{p['t_ci'][0]:+.3f}, {p['t_ci'][1]:+.3f}] | "
                f"[{p['bootstrap_ci'][0]:+.3f}, {p['bootstrap_ci'][1]:+.3f}] |"
            )
    if results["correlation"]:
        names = list(next(iter(results["correlation"].values()))["rows"])
        lines += [
            "",
            "Pearson r with Monte-Carlo A* (Section 5.3.2, warm-start policy, oracle values at each sigma; 95% "
            "intervals resample spans):",
            "",
            "| sigma | " + " | ".join(names) + " |",
            "|---:|" + "---|" * len(names),
        ]
        for sigma, c in results["correlation"].items():
            cells = [
                f"{c['rows'][k]['r']:.3f} [{c['rows'][k]['ci'][0]:.3f}, {c['rows'][k]['ci'][1]:.3f}]"
                for k in names
            ]
            lines.append(f"| {float(sigma):g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "![success vs sigma](success_vs_sigma.png)",
        "",
        "![paired sae - gae](paired_sae_minus_gae.png)",
        "",
        "![learning curves](learning_curves.png)",
        "",
        *common.report_footer(results),
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], runs: Sequence[lh.RunResult], output_dir: Path) -> None:
    """success_vs_sigma.png, paired_sae_minus_gae.png, learning_curves.png, correlation_vs_sigma.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = results["settings"]
    sigmas = [s["sigma"] for s in results["summaries"]]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for estimator in settings["estimators"]:
        for axis, key in zip(axes, ("final_success", "auc")):
            means, stds = [], []
            for summary in results["summaries"]:
                row = next((r for r in summary["rows"] if r["estimator"] == estimator), None)
                means.append(row[f"{key}_mean"] if row else math.nan)
                stds.append(row[f"{key}_std"] if row else math.nan)
            axis.errorbar(
                sigmas,
                means,
                yerr=stds,
                marker="o",
                capsize=3,
                label=estimator,
                color=common.COLOURS.get(estimator),
            )
    for axis, title in zip(axes, ("final held-out success", "area under the success curve")):
        axis.axhline(results["warm_success"], color="grey", ls=":", label="warm start")
        axis.set_xlabel("sigma (std of the critic's noise)")
        axis.set_title(f"{title} (mean ± std over seeds)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(output_dir / "success_vs_sigma.png", dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for axis, metric in zip(axes, ("final_success", "auc")):
        for versus in [e for e in settings["estimators"] if e != "sae"]:
            points = [
                next((p for p in s["paired"] if p["versus"] == versus and p["metric"] == metric), None)
                for s in results["summaries"]
            ]
            means = [p["mean"] if p else math.nan for p in points]
            low = [p["mean"] - p["t_ci"][0] if p else math.nan for p in points]
            high = [p["t_ci"][1] - p["mean"] if p else math.nan for p in points]
            axis.errorbar(
                sigmas,
                means,
                yerr=[low, high],
                marker="o",
                capsize=3,
                label=f"sae - {versus}",
                color=common.COLOURS.get(versus),
                lw=2.5 if versus == "gae" else 1,
                alpha=1.0 if versus == "gae" else 0.5,
            )
        axis.axhline(0, color="black", lw=0.8)
        axis.set_xlabel("sigma")
        axis.set_title(f"paired sae minus other, {metric} (t 95% interval)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(output_dir / "paired_sae_minus_gae.png", dpi=100)
    plt.close(figure)

    by_sigma: dict[float, list[lh.RunResult]] = {}
    for sigma, run in zip(results["run_sigmas"], runs):
        by_sigma.setdefault(sigma, []).append(run)
    figure, axes = plt.subplots(
        1, len(sigmas), figsize=(4 * len(sigmas), 3.6), constrained_layout=True, squeeze=False
    )
    for axis, sigma in zip(axes[0], sigmas):
        for estimator in settings["estimators"]:
            mine = [r for r in by_sigma.get(sigma, []) if r.estimator == estimator]
            if not mine:
                continue
            curve = np.mean([r.eval_success for r in mine], axis=0)
            axis.plot(
                mine[0].eval_steps, curve, marker="o", label=estimator, color=common.COLOURS.get(estimator)
            )
        axis.set_title(f"sigma = {sigma:g}: held-out success (mean of seeds)")
        axis.set_xlabel("PPO step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(output_dir / "learning_curves.png", dpi=100)
    plt.close(figure)

    if results["correlation"]:
        figure, axis = plt.subplots(figsize=(6, 4), constrained_layout=True)
        correlation = results["correlation"]
        points = sorted((float(k), v) for k, v in correlation.items())
        for name in next(iter(correlation.values()))["rows"]:
            r = [v["rows"][name]["r"] for _, v in points]
            low = [v["rows"][name]["r"] - v["rows"][name]["ci"][0] for _, v in points]
            high = [v["rows"][name]["ci"][1] - v["rows"][name]["r"] for _, v in points]
            axis.errorbar(
                [k for k, _ in points],
                r,
                yerr=[low, high],
                marker="o",
                capsize=3,
                label=name,
                color=common.COLOURS.get(name),
            )
        axis.set_xlabel("sigma")
        axis.set_ylabel("Pearson r with A*")
        axis.set_title("advantages vs Monte-Carlo A* (warm-start policy)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.savefig(output_dir / "correlation_vs_sigma.png", dpi=100)
        plt.close(figure)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every stage on tiny sizes, in seconds")
    parser.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=None, help="default: all four")
    parser.add_argument("--sigmas", nargs="+", type=float, default=None, help="default: 0 0.1 0.25 0.5")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 3")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--prompts-per-step", type=int, default=None)
    parser.add_argument("--num-generations", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None, help="actor lr")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--eval-size", type=int, default=None)
    parser.add_argument("--eval-samples", type=int, default=None)
    parser.add_argument(
        "--extra",
        type=json.loads,
        default=None,
        help="other SAEPPOConfig fields as JSON, the same for every run (e.g. '{\"kl_coef\": 0.1}')",
    )
    parser.add_argument("--no-correlation", action="store_true")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument(
        "--warm-start-dir", type=Path, default=None, help="warm-start cache (default: a temporary folder)"
    )
    parser.add_argument("--num-threads", type=int, default=1)
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    settings = smoke_settings() if args.smoke else default_settings()
    overrides = {
        "estimators": tuple(args.estimators) if args.estimators else None,
        "sigmas": tuple(args.sigmas) if args.sigmas else None,
        "seeds": tuple(args.seeds) if args.seeds else None,
        "steps": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "num_generations": args.num_generations,
        "learning_rate": args.learning_rate,
        "eval_every": args.eval_every,
        "eval_size": args.eval_size,
        "eval_samples": args.eval_samples,
        "extra": args.extra,
    }
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.no_correlation:
        settings = replace(settings, correlation=False)
    if any(s < 0 for s in settings.sigmas):
        raise SystemExit("--sigmas must be >= 0.")
    if settings.steps < 1 or settings.eval_every < 1:
        raise SystemExit("--steps and --eval-every must be >= 1.")
    return settings


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweep and write its outputs; returns the results dictionary (also saved as JSON)."""
    return common.run_script(argv, _SCRIPT, parse_args, settings_from_args, run_sweep)


def run_sweep(settings: Settings, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Warm start, correlation at each sigma, every (sigma, seed, estimator) run; then summaries and figures."""
    from transformers import AutoModelForCausalLM

    from trl_sae.demo.tiny import build_char_tokenizer

    output_dir: Path = args.output_dir
    (output_dir / "command.txt").write_text(command + "\n")
    print(f"command: {command}", flush=True)
    total_start = time.perf_counter()
    tokenizer = build_char_tokenizer()
    scratch = Path(tempfile.mkdtemp(prefix="known_error_critic_"))
    warm_root = args.warm_start_dir if args.warm_start_dir is not None else scratch / "warm"
    f = settings.filler_lengths[0]
    runs: list[lh.RunResult] = []
    run_sigmas: list[float] = []
    rates: dict[str, list[float]] = {}
    correlation: dict[str, Any] = {}
    try:
        splits = lh.make_splits(settings, f)
        warm_dir, warm = lh.build_warm_start(settings, f, splits, tokenizer, warm_root)
        test_set = splits["test"].select(range(min(settings.eval_size, len(splits["test"]))))
        warm_policy = AutoModelForCausalLM.from_pretrained(warm_dir)
        warm["eval"] = lh.evaluate(warm_policy, tokenizer, test_set, settings)
        print(f"warm start {warm_dir}: held-out success {warm['eval']['success']:.3f}", flush=True)
        if settings.correlation:
            for sigma in settings.sigmas:
                correlation[f"{sigma:g}"] = c = correlation_at(
                    warm_policy, tokenizer, splits, settings, sigma
                )
                cells = ", ".join(f"{k} {v['r']:.3f}" for k, v in c["rows"].items())
                print(f"[sigma={sigma:g}] r with A*: {cells} ({c['seconds']:.0f} s)", flush=True)
        # Seed-major: an interrupted sweep has whole seeds of every (sigma, estimator) cell.
        for seed in settings.seeds:
            for sigma in settings.sigmas:
                for estimator in settings.estimators:
                    saved = run_path(output_dir, settings, sigma, estimator, seed)
                    key = f"sigma{sigma:g}-{estimator}-seed{seed}"
                    if saved.exists():
                        payload = json.loads(saved.read_text())
                        result, rates[key] = lh.RunResult(**payload["result"]), payload["oracle_rates"]
                        print(f"[sigma={sigma:g} {estimator} seed {seed}] reused {saved}", flush=True)
                    else:
                        result, rates[key] = run_one(
                            estimator,
                            seed,
                            sigma,
                            settings,
                            warm_dir,
                            splits,
                            tokenizer,
                            warm["eval"],
                            scratch,
                        )
                        payload = {"settings": asdict(settings), "sigma": sigma, "result": asdict(result)}
                        common.save_json_atomically(saved, {**payload, "oracle_rates": rates[key]})
                        print(
                            f"[sigma={sigma:g} {estimator} seed {seed}] done in {result.seconds:.0f} s "
                            f"({result.cpu_seconds:.0f} s CPU)",
                            flush=True,
                        )
                    runs.append(result)
                    run_sigmas.append(sigma)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summaries = [
        summarise_sigma([r for r, s in zip(runs, run_sigmas) if s == sigma], rates, settings, sigma)
        for sigma in settings.sigmas
    ]
    results = {
        "command": command,
        "environment": common.environment(),
        "settings": asdict(settings),
        "samples_per_run": settings.steps * settings.batch_size,
        "warm_start": {k: v for k, v in warm.items() if k != "eval"},
        "warm_success": warm["eval"]["success"],
        "summaries": summaries,
        "correlation": correlation,
        "oracle_rates": rates,
        "run_sigmas": run_sigmas,
        "runs": [asdict(r) for r in runs],
        "total_seconds": time.perf_counter() - total_start,
    }
    plot(results, runs, output_dir)
    (output_dir / "results.json").write_text(json.dumps(common.finite(results), indent=1) + "\n")
    (output_dir / "results.md").write_text(markdown(results))
    print(markdown(results), flush=True)
    return results


if __name__ == "__main__":
    main()
