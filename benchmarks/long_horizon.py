"""Long-horizon testbed: SAE against GAE, Monte-Carlo, adaptive lambda and GRPO where segmentation matters.

The task is the demo's ``decision`` task (:mod:`trl_sae.demo.decision_task`): long completions (one line per
step, ``filler_length`` characters of deterministic filler between decisions) with ``num_decisions`` known
decision tokens on which the warm-started policy is genuinely uncertain, and an outcome reward only at the
end. For each filler length (the gap between decisions):

1. one SFT warm start on a sloppy teacher, saved under ``--warm-start-dir`` and reused when its settings
   (fingerprint) match;
2. every estimator x seed trained from it with the same PPO settings and sample budget; held-out success
   (sampled at the rollout temperature, ``--eval-samples`` per prompt, the same sampling seed for every
   run) every ``--eval-every`` steps;
3. summaries: final success mean ± std, area under the success curve, steps to a threshold, and a paired
   comparison across seeds of sae against each other estimator (mean difference, t and bootstrap 95%
   intervals);
4. probability segmentation against the true decision tokens: precision and recall of the boundaries at
   each ``p`` on the warm start's samples and on each run's final samples;
5. the paper's Section 5.3.2 analysis (:func:`trl_sae.analysis.correlate_advantages`) on the critic and
   policy of the first seed's SAE run.

Outputs (``--output-dir``, default ``benchmarks/results/long_horizon/``): ``results.json`` (everything,
per-seed curves included), ``results.md`` (tables), ``learning_curves.png``, ``paired_differences.png``,
``segmentation_precision_recall.png``, ``advantage_correlation_f<L>.{png,json}``, ``command.txt`` and
``run.log`` (the printed progress).

``python benchmarks/long_horizon.py --smoke`` runs every stage in seconds on tiny sizes (not a result).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

# The shared pieces (offline environment, report writing, the warm-start cache, curves, paired statistics) live
# in _common.py next to this file; the estimator settings in the sample-efficiency benchmark.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import _sweep as sweep
import numpy as np
import sample_efficiency as se
import torch
from transformers import TrainerCallback

from trl_sae.demo.decision_task import DECISION_DEFAULTS

ESTIMATORS = se.ESTIMATORS
COLOURS = common.COLOURS
_SCRIPT = "benchmarks/long_horizon.py"
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results" / "long_horizon"
P_GRID = (0.05, 0.1, 0.2, 0.3, 0.5)


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------
@dataclass
class Settings(sweep.PPOSettings):
    """Everything that defines a run; saved verbatim with the results."""

    # Task (trl_sae.demo.decision_task)
    num_decisions: int = DECISION_DEFAULTS.num_decisions
    filler_lengths: tuple[int, ...] = (8, 32)
    n_doors: int = DECISION_DEFAULTS.n_doors
    teacher_error_rate: float = DECISION_DEFAULTS.teacher_error_rate
    n_train: int = DECISION_DEFAULTS.n_train
    n_test: int = DECISION_DEFAULTS.n_test
    data_seed: int = 0
    # Model and warm start (trl_sae.demo.tiny, trl_sae.demo.warmstart)
    hidden_size: int = DECISION_DEFAULTS.hidden_size
    num_layers: int = DECISION_DEFAULTS.num_layers
    num_heads: int = DECISION_DEFAULTS.num_heads
    sft_steps: int = DECISION_DEFAULTS.sft_max_steps
    # Per-length SFT budgets (length, steps) over ``sft_steps``, so one command reproduces every length: on this
    # machine 400 steps left the filler-32 warm start at 0% success (its filler not yet deterministic), 800 gave
    # 33% (benchmarks/experiments/long-horizon.md, "Full sweep").
    sft_steps_by_length: tuple[tuple[int, int], ...] = ((32, 800),)
    sft_learning_rate: float = DECISION_DEFAULTS.sft_learning_rate
    sft_batch_size: int = DECISION_DEFAULTS.sft_batch_size
    # RL (the rest in sweep.PPOSettings): 16 steps x 5 estimators x 5 seeds fit ~35 min (filler 8) / ~70 min
    # (filler 32) of one idle core.
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    steps: int = 16
    temperature: float = DECISION_DEFAULTS.rollout_temperature
    # Pilot (benchmarks/experiments/archive/long-horizon.md): at 1e-4 (the sample-efficiency benchmark's rate) every
    # estimator collapsed on 400-token walks within 4 steps (success 0.22 -> 0.005-0.03); 3e-5 kept the policy intact.
    learning_rate: float = 3e-5
    # Evaluation: sampled success at the rollout temperature on held-out prompts
    eval_every: int = 4
    eval_size: int = 100
    eval_samples: int = 2
    eval_seed: int = 1234
    p_grid: tuple[float, ...] = P_GRID
    # Advantage correlation (Section 5.3.2) on the first seed's SAE critic, per filler length
    corr_trajectories: int = 48
    corr_spans: int = 2
    corr_continuations: int = 16
    corr_bootstrap: int = 500
    # Paired comparison
    bootstrap: int = 2000
    extra: dict[str, Any] = field(default_factory=dict)

    def sft_steps_for(self, filler_length: int) -> int:
        """SFT steps of the warm start at ``filler_length``: its entry in ``sft_steps_by_length``, else ``sft_steps``."""
        return dict(self.sft_steps_by_length).get(filler_length, self.sft_steps)

    def response_length(self, filler_length: int) -> int:
        """Generation budget: a well-formed completion + EOS + a margin (see ``DecisionDefaults``)."""
        return replace(
            DECISION_DEFAULTS, num_decisions=self.num_decisions, filler_length=filler_length
        ).max_new_tokens


def smoke_settings() -> Settings:
    """Every stage on tiny sizes: 1 seed x 2 steps, 2 short filler lengths, 3 decisions. Not a result."""
    walk = {"num_decisions": 3, "filler_lengths": (2, 6), "sft_steps_by_length": (), "eval_samples": 1}
    return Settings(**sweep.SMOKE_SIZES, **walk, eval_size=4, bootstrap=50)


# --------------------------------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------------------------------
def make_splits(settings: Settings, filler_length: int) -> Any:
    from trl_sae.demo.decision_task import make_walk_splits

    return make_walk_splits(
        settings.n_train,
        settings.n_test,
        num_decisions=settings.num_decisions,
        filler_length=filler_length,
        n_doors=settings.n_doors,
        seed=settings.data_seed,
        teacher_error_rate=settings.teacher_error_rate,
    )


def warm_start_fingerprint(settings: Settings, filler_length: int) -> dict[str, Any]:
    """The settings that determine a warm start (JSON-normalised, so tuples equal saved lists)."""
    task = {"num_decisions": settings.num_decisions, "n_doors": settings.n_doors, "task": "decision"}
    return sweep.warm_start_fingerprint(
        settings, settings.sft_steps_for(filler_length), **task, filler_length=filler_length
    )


def build_warm_start(
    settings: Settings, filler_length: int, splits: Any, tokenizer: Any, root: Path
) -> tuple[Path, dict[str, Any]]:
    """SFT once per fingerprint under ``root/decision-f<L>-<hash>``; reuse a saved one whose fingerprint matches."""
    fingerprint = warm_start_fingerprint(settings, filler_length)
    return sweep.warm_start(settings, splits, tokenizer, root, f"decision-f{filler_length}", fingerprint)


def evaluate(policy: torch.nn.Module, tokenizer: Any, test_set: Any, settings: Settings) -> dict[str, Any]:
    """Held-out success (sampled at the rollout temperature) and segmentation precision/recall vs p.

    The same sampling seed for every run and step (common random numbers: paired runs differ by their
    policies, not by the evaluation's draws); the caller's RNG stream is left untouched.
    """
    from trl_sae.demo.decision_task import decision_segmentation

    result = decision_segmentation(
        policy,
        tokenizer,
        test_set,
        p_grid=settings.p_grid,
        num_samples=settings.eval_samples,
        temperature=settings.temperature,
        seed=settings.eval_seed,
    )
    result.pop("samples")
    return result


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One (filler length, estimator, seed) run."""

    filler_length: int
    estimator: str
    seed: int
    eval_steps: list[int]
    eval_success: list[float]
    final_segmentation: dict[str, Any]
    train: dict[str, list[float]]
    seconds: float
    # This process's CPU time for the run: on a shared machine the wall time counts other people's jobs.
    cpu_seconds: float = math.nan


class HeldOutEvaluation(TrainerCallback):
    """Held-out success every ``eval_every`` steps and after the last, with a progress line."""

    def __init__(
        self, policy: Any, tokenizer: Any, test_set: Any, settings: Settings, label: str, warm: dict[str, Any]
    ) -> None:
        self.policy, self.tokenizer, self.test_set, self.settings, self.label = (
            policy,
            tokenizer,
            test_set,
            settings,
            label,
        )
        self.steps: list[int] = [0]
        self.success: list[float] = [warm["success"]]
        self.last: dict[str, Any] = warm
        self.start = time.perf_counter()
        self.pending = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step % self.settings.eval_every and step != state.max_steps:
            return
        self.last = evaluate(self.policy, self.tokenizer, self.test_set, self.settings)
        self.steps.append(step)
        self.success.append(float(self.last["success"]))
        self.pending = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not self.pending or not logs or "reward/mean" not in logs:
            return
        self.pending = False
        seg = self.last["by_p"].get(self.settings.segment_threshold) or next(iter(self.last["by_p"].values()))
        print(
            f"{self.label} step {self.steps[-1]:>3}/{state.max_steps}  held-out success {self.success[-1]:.3f}  "
            f"train reward {logs.get('reward/mean', math.nan):.3f}  "
            f"boundaries/completion {logs.get('segments/boundaries_per_completion', math.nan):.1f}  "
            f"P/R@p={self.settings.segment_threshold:g} {seg['precision']:.2f}/{seg['recall']:.2f}  "
            f"len {logs.get('completions/mean_length', math.nan):.0f}  "
            f"({time.perf_counter() - self.start:.0f} s)",
            flush=True,
        )


@dataclass
class WalkStart:
    """What every run at one filler length starts from: the splits, the warm start and its held-out evaluation
    (``warm["eval"]``), the tokenizer and the scratch folder for trainer outputs."""

    filler_length: int
    splits: Any
    warm_dir: Path
    warm: dict[str, Any]
    tokenizer: Any
    scratch: Path

    def test_set(self, settings: Settings) -> Any:
        """The held-out prompts every evaluation scores (the first ``eval_size``)."""
        return self.splits["test"].select(range(min(settings.eval_size, len(self.splits["test"]))))

    def train_set(self) -> Any:
        """The training prompts, without the teacher's solutions (PPO samples its own)."""
        return self.splits["train"].remove_columns(["solution", "solution_is_correct"])

    def trainer_inputs(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A trainer's arguments for one run: the warm start's weights, the walk reward, ``SAEPPOConfig(**fields)``,
        the training prompts and the tokenizer."""
        from transformers import AutoModelForCausalLM

        from trl_sae import SAEPPOConfig
        from trl_sae.demo.decision_task import walk_reward

        return {
            "model": AutoModelForCausalLM.from_pretrained(self.warm_dir),
            "reward_funcs": walk_reward,
            "args": SAEPPOConfig(**fields),
            "train_dataset": self.train_set(),
            "processing_class": self.tokenizer,
        }

    def result(
        self,
        estimator: str,
        seed: int,
        evaluator: HeldOutEvaluation,
        train: dict[str, list[float]],
        times: tuple[float, float],
        warmup_steps: int = 0,
    ) -> RunResult:
        """A run's record from its evaluator (curve, final segmentation), metrics and (wall, CPU) seconds.

        With ``warmup_steps`` critic-only steps first, steps count actor steps: the evaluations during the
        warm-up (the policy has not moved from the warm start, evaluated at index 0) are dropped.
        """
        steps = [0] + [s - warmup_steps for s in evaluator.steps[1:]]
        kept = [0] + [i for i in range(1, len(steps)) if steps[i] > 0]
        curve = [steps[i] for i in kept], [evaluator.success[i] for i in kept]
        by_p = {str(p): v for p, v in evaluator.last["by_p"].items()}
        return RunResult(self.filler_length, estimator, seed, *curve, by_p, train, *times)


def run_one(
    estimator: str, seed: int, settings: Settings, start: WalkStart, keep: bool = False
) -> tuple[RunResult, Any]:
    """Train one estimator from the warm start; returns its result and, if ``keep``, the trainer."""

    from trl_sae import SAEPPOTrainer

    f = start.filler_length
    fields = sweep.ppo_fields(
        settings,
        start.scratch / f"f{f}-{estimator}-seed{seed}",
        seed,
        max_steps=settings.steps,
        response_length=settings.response_length(f),
        value_warmup_steps=settings.value_warmup_steps,
    )
    fields.update(se.estimator_overrides(estimator, se.Settings()))
    fields.update(settings.extra)
    trainer = SAEPPOTrainer(**start.trainer_inputs(fields))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    label = f"[f={f} {estimator} seed {seed}]"
    evaluator = HeldOutEvaluation(
        unwrapped.policy, start.tokenizer, start.test_set(settings), settings, label, start.warm["eval"]
    )
    times = sweep.train(trainer, evaluator)
    result = start.result(estimator, seed, evaluator, sweep.train_metrics(trainer, se.TRAIN_KEYS), times)
    return result, (trainer if keep else None)


def run_settings_fingerprint(settings: Settings, filler_length: int | None = None) -> str:
    """A digest of every setting that shapes one run (not which seeds, estimators or lengths are swept).

    With ``filler_length`` its warm start's SFT budget is the ``sft_steps`` digested (the per-length table
    itself is not), so a run's digest is the same whether its budget came from the table or ``--sft-steps``.
    """
    data = asdict(settings)
    if filler_length is not None:
        data["sft_steps"] = settings.sft_steps_for(filler_length)
    swept = ("estimators", "seeds", "filler_lengths", "threshold", "bootstrap", "sft_steps_by_length")
    return sweep.run_fingerprint(data, swept)


def run_result_path(
    output_dir: Path, settings: Settings, filler_length: int, estimator: str, seed: int
) -> Path:
    """Where one finished run is kept, so an interrupted sweep resumes at the first missing run."""
    name = f"f{filler_length}-{estimator}-seed{seed}-{run_settings_fingerprint(settings, filler_length)}.json"
    return output_dir / "runs" / name


# --------------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------------
# Shared with the other benchmarks (kept under these names: tests and known_error_critic.py use them).
curve_auc = common.curve_auc
paired_difference = common.paired_difference


def summarise(
    runs: Sequence[RunResult], settings: Settings, filler_length: int, threshold: float
) -> dict[str, Any]:
    """Per estimator: final success, AUC, steps to threshold, segments; and sae vs each other, paired by seed."""
    rows = []
    by_estimator: dict[str, dict[int, RunResult]] = {}
    for run in runs:
        if run.filler_length == filler_length:
            by_estimator.setdefault(run.estimator, {})[run.seed] = run
    for estimator in settings.estimators:
        mine = list(by_estimator.get(estimator, {}).values())
        if not mine:
            continue
        aucs = [curve_auc(r.eval_steps, r.eval_success) for r in mine]
        auc_mean, auc_std = common.mean_std(aucs)
        seg = [r.final_segmentation.get(str(settings.segment_threshold)) for r in mine]
        rows.append(
            {
                "estimator": estimator,
                "seeds": [r.seed for r in mine],
                **common.curve_summary([(r.eval_steps, r.eval_success) for r in mine], threshold, "success"),
                "auc_mean": auc_mean,
                "auc_std": auc_std,
                "auc_per_seed": aucs,
                "train_boundaries_per_completion": float(
                    np.mean([np.nanmean(r.train["segments/boundaries_per_completion"]) for r in mine])
                ),
                "final_precision": float(np.nanmean([s["precision"] for s in seg if s]))
                if any(seg)
                else None,
                "final_recall": float(np.nanmean([s["recall"] for s in seg if s])) if any(seg) else None,
                "mean_completion_length": float(
                    np.mean([np.nanmean(r.train["completions/mean_length"]) for r in mine])
                ),
                "seconds_per_run": float(np.mean([r.seconds for r in mine])),
                "cpu_seconds_per_run": float(np.mean([r.cpu_seconds for r in mine])),
            }
        )
    paired = []
    sae = by_estimator.get("sae", {})
    for estimator in settings.estimators:
        other = by_estimator.get(estimator, {})
        seeds = sorted(set(sae) & set(other))
        if estimator == "sae" or not seeds:
            continue
        for metric, value in (
            ("final_success", lambda r: r.eval_success[-1]),
            ("auc", lambda r: curve_auc(r.eval_steps, r.eval_success)),
        ):
            stats = paired_difference(
                [value(sae[s]) for s in seeds], [value(other[s]) for s in seeds], settings.bootstrap, seed=0
            )
            paired.append({"versus": estimator, "metric": metric, "seeds": seeds, **stats})
    return {"filler_length": filler_length, "threshold": threshold, "rows": rows, "paired": paired}


def default_threshold(runs: Sequence[RunResult], filler_length: int, warm_success: float) -> float:
    """Warm start plus half of the best estimator's mean gain at this filler length."""
    finals: dict[str, list[float]] = {}
    for run in runs:
        if run.filler_length == filler_length:
            finals.setdefault(run.estimator, []).append(run.eval_success[-1])
    best = max(float(np.mean(v)) for v in finals.values())
    return warm_success + 0.5 * max(0.0, best - warm_success)


def markdown_tables(summary: dict[str, Any], settings: Settings, warm: dict[str, Any]) -> str:
    """The per-estimator table, the paired table and the warm start's segmentation table for one filler length."""
    f = summary["filler_length"]
    n = len(settings.seeds)
    lines = [
        f"### Filler length {f} (completions of ~{warm['eval']['mean_length']:.0f} tokens, "
        f"{settings.num_decisions} decisions)",
        "",
        f"Warm start: held-out success {warm['eval']['success']:.3f} (sampled, T = {settings.temperature:g}); "
        f"{warm['eval']['by_p'][settings.segment_threshold]['boundaries_per_completion']:.1f} boundaries per "
        f"completion at p = {settings.segment_threshold:g}.",
        "",
        f"| estimator | final success (mean ± std, {n} seeds) | per seed | AUC (mean ± std) | steps to ≥ "
        f"{summary['threshold']:.2f} (seeds reaching) | boundaries / completion (train) | P / R at p = "
        f"{settings.segment_threshold:g} (final) | s / run |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in summary["rows"]:
        per_seed = ", ".join(f"{v:.3f}" for v in row["final_success_per_seed"])
        reach = (
            f"never (0/{len(row['seeds'])})"
            if row["steps_to_threshold_mean"] is None
            else f"{row['steps_to_threshold_mean']:.1f} ({row['seeds_reaching_threshold']}/{len(row['seeds'])})"
        )
        pr = (
            f"{row['final_precision']:.2f} / {row['final_recall']:.2f}"
            if row["final_precision"] is not None
            else "n/a"
        )
        lines.append(
            f"| {row['estimator']} | {row['final_success_mean']:.3f} ± {row['final_success_std']:.3f} | {per_seed} | "
            f"{row['auc_mean']:.3f} ± {row['auc_std']:.3f} | {reach} | {row['train_boundaries_per_completion']:.1f} | "
            f"{pr} | {row['seconds_per_run']:.0f} |"
        )
    lines += [
        "",
        "Paired by seed, sae minus each estimator (positive: sae better); 95% intervals (t over seeds, bootstrap over seeds):",
        "",
        "| versus | metric | mean difference | t 95% CI | bootstrap 95% CI | per seed |",
        "|---|---|---:|---|---|---|",
    ]
    for item in summary["paired"]:
        lines.append(
            f"| {item['versus']} | {item['metric']} | {item['mean']:+.3f} | "
            f"[{item['t_ci'][0]:+.3f}, {item['t_ci'][1]:+.3f}] | "
            f"[{item['bootstrap_ci'][0]:+.3f}, {item['bootstrap_ci'][1]:+.3f}] | "
            + ", ".join(f"{v:+.3f}" for v in item["per_seed"])
            + " |"
        )
    lines += [
        "",
        "Probability segmentation vs the true decision tokens, warm start's held-out samples:",
        "",
        "| p | boundaries / completion | precision | recall |",
        "|---:|---:|---:|---:|",
    ]
    for p, v in warm["eval"]["by_p"].items():
        lines.append(
            f"| {float(p):g} | {v['boundaries_per_completion']:.2f} | {v['precision']:.3f} | {v['recall']:.3f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------
def _figure(ncols: int, nrows: int = 1, width: float = 5.5, height: float = 4.0) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False)
    return figure, axes


def plot_learning_curves(
    runs: Sequence[RunResult], settings: Settings, summaries: Sequence[dict[str, Any]], path: Path
) -> None:
    """Held-out success vs samples, one panel per filler length (mean line, min-max band over seeds)."""
    figure, axes = _figure(len(summaries))
    for axis, summary in zip(axes[0], summaries):
        f = summary["filler_length"]
        for estimator in settings.estimators:
            mine = [r for r in runs if r.filler_length == f and r.estimator == estimator]
            if not mine:
                continue
            samples = np.asarray(mine[0].eval_steps) * settings.batch_size
            values = np.asarray([r.eval_success for r in mine])
            colour = COLOURS.get(estimator, "black")
            axis.plot(samples, values.mean(axis=0), "o-", color=colour, markersize=3, label=estimator)
            axis.fill_between(samples, values.min(axis=0), values.max(axis=0), color=colour, alpha=0.15)
        axis.axhline(summary["threshold"], color="grey", linestyle=":", linewidth=1)
        axis.set_title(f"filler {f}: held-out success ({len(settings.seeds)} seeds)")
        axis.set_xlabel("training samples (completions)")
        axis.set_ylabel(f"success (sampled, T={settings.temperature:g})")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(path, dpi=100)


def plot_paired(summaries: Sequence[dict[str, Any]], path: Path) -> None:
    """sae minus each estimator (final success and AUC), mean and t interval, one panel per filler length."""
    figure, axes = _figure(len(summaries))
    for axis, summary in zip(axes[0], summaries):
        items = summary["paired"]
        labels = [f"{i['versus']}\n{i['metric']}" for i in items]
        means = np.asarray([i["mean"] for i in items])
        low = np.asarray([i["t_ci"][0] for i in items])
        high = np.asarray([i["t_ci"][1] for i in items])
        x = np.arange(len(items))
        colours = [COLOURS.get(i["versus"], "black") for i in items]
        axis.bar(x, means, color=colours, alpha=0.7)
        finite = np.isfinite(low) & np.isfinite(high)
        if finite.any():
            axis.errorbar(
                x[finite],
                means[finite],
                yerr=[means[finite] - low[finite], high[finite] - means[finite]],
                fmt="none",
                color="black",
                capsize=3,
            )
        axis.axhline(0, color="black", linewidth=0.8)
        axis.set_xticks(x, labels, fontsize=7)
        axis.set_title(f"filler {summary['filler_length']}: sae minus other (95% t CI)")
        axis.grid(alpha=0.3, axis="y")
    figure.savefig(path, dpi=100)


def plot_precision_recall(
    warm: dict[int, dict[str, Any]], runs: Sequence[RunResult], settings: Settings, path: Path
) -> None:
    """Precision and recall of probability boundaries vs p: warm start (solid) and after sae training (dashed)."""
    figure, axes = _figure(2)
    for index, (f, info) in enumerate(sorted(warm.items())):
        colour = f"C{index}"
        ps = [float(p) for p in info["eval"]["by_p"]]
        for axis, key in zip(axes[0], ("precision", "recall")):
            axis.plot(
                ps,
                [v[key] for v in info["eval"]["by_p"].values()],
                "o-",
                color=colour,
                label=f"filler {f}, warm start",
            )
            sae_runs = [r for r in runs if r.filler_length == f and r.estimator == "sae"]
            if sae_runs:
                values = [np.nanmean([r.final_segmentation[str(p)][key] for r in sae_runs]) for p in ps]
                axis.plot(ps, values, "s--", color=colour, label=f"filler {f}, after sae")
    for axis, key in zip(axes[0], ("precision", "recall")):
        axis.set_xscale("log")
        axis.set_xticks(list(settings.p_grid), [f"{p:g}" for p in settings.p_grid])
        axis.minorticks_off()
        axis.set_xlabel("p (segmentation threshold)")
        axis.set_ylabel(key)
        axis.set_ylim(0, 1.05)
        axis.set_title(f"boundary {key} vs the true decision tokens")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(path, dpi=100)


# --------------------------------------------------------------------------------------------------
# Correlation
# --------------------------------------------------------------------------------------------------
def run_correlation(
    trainer: Any, splits: Any, tokenizer: Any, settings: Settings, filler_length: int, output_dir: Path
) -> dict[str, Any]:
    """Section 5.3.2 on the trained critic of the first seed's SAE run at this filler length."""
    from trl_sae.demo.decision_task import walk_reward

    stem = output_dir / f"advantage_correlation_f{filler_length}"
    max_new_tokens = settings.response_length(filler_length)
    return sweep.run_correlation(
        trainer, splits["test"], tokenizer, walk_reward, settings, max_new_tokens, stem
    )


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sweep.add_sweep_arguments(parser, DEFAULT_OUTPUT_DIR, ESTIMATORS, "all;0 1 2 3 4")
    parser.add_argument("--filler-lengths", nargs="+", type=int, default=None, help="default: 8 32")
    parser.add_argument("--num-decisions", type=int, default=None)
    parser.add_argument("--teacher-error-rate", type=float, default=None)
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="SFT steps at every filler length (replaces the per-length table)",
    )
    parser.add_argument(
        "--sft-steps-by-length",
        nargs="+",
        default=None,
        metavar="LENGTH:STEPS",
        help="per-length SFT budgets, e.g. 32:800 (default 32:800; other lengths get --sft-steps, default 400)",
    )
    parser.add_argument("--critic-learning-rate", type=float, default=None)
    parser.add_argument(
        "--value-warmup-steps",
        type=int,
        default=None,
        help="critic-only steps first, within --steps (GRPO has no critic and trains its actor throughout)",
    )
    parser.add_argument(
        "--extra",
        type=json.loads,
        default=None,
        help="other SAEPPOConfig fields as JSON, the same for every run (e.g. '{\"whiten_advantages\": false}')",
    )
    parser.add_argument("--eval-size", type=int, default=None, help="held-out prompts per evaluation")
    parser.add_argument("--eval-samples", type=int, default=None, help="samples per held-out prompt")
    parser.add_argument("--threshold", type=float, default=None, help="success for 'steps to threshold'")
    parser.add_argument("--corr-trajectories", type=int, default=None)
    parser.add_argument("--no-correlation", action="store_true")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    flags = ("filler_lengths", "num_decisions", "teacher_error_rate", "sft_steps", "critic_learning_rate")
    flags += ("value_warmup_steps", "extra", "eval_size", "eval_samples", "threshold", "corr_trajectories")
    settings = sweep.apply_overrides(smoke_settings() if args.smoke else Settings(), args, *flags)
    if args.sft_steps is not None:
        settings = replace(settings, sft_steps_by_length=())
    if args.sft_steps_by_length is not None:
        try:
            pairs = tuple((int(a), int(b)) for a, b in (item.split(":") for item in args.sft_steps_by_length))
        except ValueError:
            raise SystemExit(
                "--sft-steps-by-length takes LENGTH:STEPS pairs of integers, e.g. 32:800."
            ) from None
        settings = replace(settings, sft_steps_by_length=pairs)
    if args.no_correlation:
        settings = replace(settings, correlation=False)
    if not 0 <= settings.value_warmup_steps < settings.steps:
        raise SystemExit("--value-warmup-steps must be >= 0 and below --steps.")
    return settings


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweep and write its outputs; returns the results dictionary (also saved as JSON)."""
    return common.run_script(argv, _SCRIPT, parse_args, settings_from_args, run_sweep)


def warm_start_and_evaluate(settings: Settings, filler_length: int, session: sweep.Session) -> WalkStart:
    """The walk's splits, its (cached) warm start and that warm start's held-out evaluation (``warm["eval"]``)."""
    from transformers import AutoModelForCausalLM

    f = filler_length
    splits = make_splits(settings, f)
    warm_dir, warm = build_warm_start(settings, f, splits, session.tokenizer, session.warm_root)
    start = WalkStart(f, splits, warm_dir, warm, session.tokenizer, session.scratch)
    policy = AutoModelForCausalLM.from_pretrained(warm_dir)
    warm["eval"] = evaluate(policy, session.tokenizer, start.test_set(settings), settings)
    seg = warm["eval"]["by_p"][settings.segment_threshold]
    print(
        f"[f={f}] warm start {warm_dir}: {settings.sft_steps_for(f)} SFT steps ({warm['seconds']:.0f} s"
        f"{', reused' if warm['reused'] else ''}); held-out success {warm['eval']['success']:.3f}, "
        f"{warm['eval']['mean_length']:.0f} tokens, {seg['boundaries_per_completion']:.1f} boundaries/completion "
        f"at p={settings.segment_threshold:g} (precision {seg['precision']:.2f}, recall {seg['recall']:.2f})",
        flush=True,
    )
    return start


def run_length(
    settings: Settings, filler_length: int, args: argparse.Namespace, session: sweep.Session
) -> tuple[list[RunResult], dict[str, Any], dict[str, Any] | None]:
    """One filler length: warm start, every (seed, estimator) run, the correlation on the first seed's SAE run."""
    f = filler_length
    start = warm_start_and_evaluate(settings, f, session)
    kept: dict[str, Any] = {}
    path = partial(run_result_path, args.output_dir, settings, f)
    one = partial(run_one, settings=settings, start=start)
    payloads = sweep.run_estimators(settings, path, one, kept, args.commit, label=f"f={f} ")
    correlation = None
    if "trainer" in kept:
        print(f"[f={f}] advantage correlation on the SAE critic (seed {settings.seeds[0]}) ...", flush=True)
        trainer = kept.pop("trainer")
        correlation = run_correlation(trainer, start.splits, session.tokenizer, settings, f, args.output_dir)
        print(correlation["table"], flush=True)
    return [RunResult(**p["result"]) for p in payloads], start.warm, correlation


def run_sweep(settings: Settings, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Per filler length: warm start, every (seed, estimator) run, correlation; then summaries and figures."""
    output_dir: Path = args.output_dir
    runs: list[RunResult] = []
    warm_info: dict[int, dict[str, Any]] = {}
    correlations: dict[int, dict[str, Any]] = {}
    with sweep.session(args, command, "long_horizon_") as session:
        for f in settings.filler_lengths:
            length_runs, warm_info[f], correlation = run_length(settings, f, args, session)
            runs += length_runs
            if correlation is not None:
                correlations[f] = correlation

    summaries = []
    for f in settings.filler_lengths:
        threshold = (
            settings.threshold
            if settings.threshold is not None
            else default_threshold(runs, f, warm_info[f]["eval"]["success"])
        )
        summaries.append(summarise(runs, settings, f, threshold))
    plot_learning_curves(runs, settings, summaries, output_dir / "learning_curves.png")
    plot_paired(summaries, output_dir / "paired_differences.png")
    plot_precision_recall(warm_info, runs, settings, output_dir / "segmentation_precision_recall.png")
    tables = [markdown_tables(s, settings, warm_info[s["filler_length"]]) for s in summaries]
    results = {
        "command": command,
        "environment": session.env,
        "settings": asdict(settings),
        "samples_per_run": settings.steps * settings.batch_size,
        "warm_starts": {str(f): w for f, w in warm_info.items()},
        "summaries": summaries,
        "runs": [asdict(r) for r in runs],
        "correlation": {str(f): c["result"] for f, c in correlations.items()},
        "correlation_seconds": {str(f): c["seconds"] for f, c in correlations.items()},
        "total_seconds": session.seconds(),
    }
    for table in tables:
        print(table, flush=True)
    sweep.finish_sweep(output_dir, results, results_markdown(results, tables, correlations))
    return results


def results_markdown(
    results: dict[str, Any], tables: Sequence[str], correlations: dict[int, dict[str, Any]]
) -> str:
    s = results["settings"]
    budgets = dict(map(tuple, s["sft_steps_by_length"]))
    warm_steps = ", ".join(f"{budgets.get(f, s['sft_steps'])} (filler {f})" for f in s["filler_lengths"])
    lines = [
        "# Long-horizon testbed: the decision task",
        "",
        f"{s['num_decisions']} decisions per completion, filler lengths {s['filler_lengths']}, {s['n_doors']} doors, "
        f"teacher error rate {s['teacher_error_rate']:g}; warm start SFT steps {warm_steps} (hidden "
        f"{s['hidden_size']}, {s['num_layers']} layers). Every run: {s['steps']} PPO steps x {s['prompts_per_step']} "
        f"prompts x {s['num_generations']} generations = {results['samples_per_run']} completions; actor lr "
        f"{s['learning_rate']:g}, critic lr {s['critic_learning_rate']:g}, T = {s['temperature']:g}, "
        f"{s['num_ppo_epochs']} PPO epochs x {s['num_mini_batches']} mini-batches; SAE p = {s['segment_threshold']:g}, "
        f"lam = {s['lam']:g}. Held-out success: {s['eval_size']} unseen prompts x {s['eval_samples']} samples at "
        f"T = {s['temperature']:g}, every {s['eval_every']} steps.",
        "",
        *[t + "\n" for t in tables],
        "![learning curves](learning_curves.png)",
        "",
        "![paired differences](paired_differences.png)",
        "",
        "![segmentation precision and recall](segmentation_precision_recall.png)",
        "",
    ]
    for f, c in sorted(correlations.items()):
        lines += [
            f"## Advantage correlation with Monte-Carlo A* (Section 5.3.2), filler {f}, SAE critic of the first seed",
            "",
            c["table"],
            "",
            f"![advantage correlation](advantage_correlation_f{f}.png)",
            "",
        ]
    lines += common.report_footer(results)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
