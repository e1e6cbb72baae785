"""CPU-scale sample-efficiency benchmark: SAE against GAE, Monte-Carlo, adaptive lambda and GRPO.

Every run starts from the *same* supervised warm start (trained once, saved, reloaded per run) on the offline
running-sum task of the demo (:mod:`trl_sae.demo.tasks`: 3-4 terms, a sloppy teacher that drops the carry 60% of
the time, so the warm-started policy is wrong in a way the verifiable reward can correct). Each estimator
trains with identical hyperparameters and the same sample budget (steps x prompts x generations) for several
seeds; the held-out greedy accuracy (:func:`trl_sae.evaluation.evaluate_accuracy`) is measured every
``--eval-every`` steps to form learning curves. Finally the advantage-correlation analysis of the paper's
Section 5.3.2 (:func:`trl_sae.analysis.correlate_advantages`) runs on the critic and policy of the first SAE
run.

Why the demo task and not the ``"long"`` variant by default: measured on the shared 2-core machine, the long
variant needs ~600 SFT steps (~4 minutes) before a warm start has any accuracy, a PPO step costs ~2x more,
and in 12-step pilots from a 40%-accurate warm start neither SAE nor GRPO improved held-out accuracy. The long
variant stays one flag away (``--variant long --sft-steps 620 --response-length 128``) for a bigger budget.

Outputs (``--output-dir``, default ``benchmarks/results/sample_efficiency/``):

* ``learning_curves.png``: held-out accuracy vs samples (mean and min-max band over seeds) and the training
  reward per step, one colour per estimator;
* ``results.md`` / ``results.json``: final accuracy (mean ± std over seeds), mean accuracy over the curve,
  steps (and samples) to reach ``--threshold``, segment statistics, the advantage-correlation table, the
  exact command and the environment (versions, torch threads, CPU load);
* ``advantage_correlation.png`` / ``advantage_correlation.json``: the Section 5.3.2 analysis;
* ``command.txt``: the command line.

Run ``python benchmarks/sample_efficiency.py`` (~20-25 minutes on 2 shared CPU cores) or ``--smoke`` for a
seconds-long end-to-end check (1 seed x 2 steps, tiny model and evaluation).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

# The shared pieces (offline environment, report writing, the warm-start cache, curves) live in _common.py next
# to this file; importing it first also sets the offline environment before transformers is imported.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import _sweep as sweep
import numpy as np
import torch
from transformers import TrainerCallback

from trl_sae.demo.tasks import DEMO_DEFAULTS

ESTIMATORS = sweep.ESTIMATORS
_SCRIPT = "benchmarks/sample_efficiency.py"
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results" / "sample_efficiency"
COLOURS = common.COLOURS


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------
@dataclass
class Settings(sweep.PPOSettings):
    """Everything that defines a benchmark run; saved verbatim with the results.

    The task, warm start and PPO values are the offline demo's (``trl_sae.demo.run.DemoConfig``, tuned there for
    a held-out gain on this task), so the benchmark measures the estimators where PPO is known to move; the
    number of steps is what 15 runs fit in ~20 minutes on 2 shared cores.
    """

    # Task (trl_sae.demo.tasks)
    variant: str = "default"
    num_terms: tuple[int, int] | None = None
    n_train: int = 2000
    n_test: int = 200
    teacher_error_rate: float = 0.6
    data_seed: int = 0
    # Model (trl_sae.demo.tiny) and the warm start (trl_sae.demo.warmstart)
    # The demo's warm start (tasks.DEMO_DEFAULTS): a competent model with one systematic, fixable error.
    hidden_size: int = DEMO_DEFAULTS.hidden_size
    num_layers: int = DEMO_DEFAULTS.num_layers
    num_heads: int = DEMO_DEFAULTS.num_heads
    sft_steps: int = DEMO_DEFAULTS.sft_max_steps
    sft_learning_rate: float = DEMO_DEFAULTS.sft_learning_rate
    sft_batch_size: int = DEMO_DEFAULTS.sft_batch_size
    # RL (the rest in sweep.PPOSettings, whose defaults are this benchmark's)
    response_length: int = 48


def smoke_settings() -> Settings:
    """1 seed x 2 steps on a tiny model and evaluation: an end-to-end check in seconds, not a result."""
    return Settings(
        **sweep.SMOKE_SIZES, variant="default", response_length=24, value_warmup_steps=0, eval_size=8
    )


def estimator_overrides(estimator: str, settings: Settings) -> dict[str, Any]:
    """The SAEPPOConfig fields that differ between estimators: the estimator and nothing else.

    ``lam`` only matters for SAE and GAE (``mc`` is lambda = 1 by definition, ``adaptive_lambda`` derives
    lambda from the length, GRPO has no critic). GRPO gets no value warm-up: it has no critic to warm up
    (``SAEPPOConfig`` rejects the combination), and its actor idling for those steps would waste samples the
    other estimators spend on their critics; the sample budget is the same either way.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"Unknown estimator {estimator!r}; choose from {list(ESTIMATORS)}.")
    from trl_sae.core.advantages import get_estimator_spec

    overrides: dict[str, Any] = {"advantage_estimator": estimator}
    if not get_estimator_spec(estimator).needs_critic:
        overrides["value_warmup_steps"] = 0
    return overrides


# --------------------------------------------------------------------------------------------------
# Data, warm start, one run
# --------------------------------------------------------------------------------------------------
def make_splits(settings: Settings) -> Any:
    """Train prompts (with worked solutions for SFT) and the held-out evaluation prompts."""
    from trl_sae.demo.tasks import make_running_sum_splits

    return make_running_sum_splits(
        settings.n_train,
        settings.n_test,
        num_terms=settings.num_terms,
        seed=settings.data_seed,
        variant=settings.variant,
        teacher_error_rate=settings.teacher_error_rate,
    )


def build_warm_start(
    settings: Settings, splits: Any, tokenizer: Any, root: Path
) -> tuple[Path, dict[str, Any]]:
    """SFT once per fingerprint under ``root/running-sum-<hash>``; reuse a saved one whose fingerprint matches.

    Returns the warm start's folder and a description (its settings, wall time, whether it was reused).
    """
    task = {"variant": settings.variant, "num_terms": settings.num_terms}
    fingerprint = sweep.warm_start_fingerprint(settings, settings.sft_steps, **task)
    return sweep.warm_start(settings, splits, tokenizer, root, "running-sum", fingerprint)


def held_out_accuracy(model: torch.nn.Module, tokenizer: Any, test_set: Any, settings: Settings) -> float:
    """Greedy accuracy on the held-out split, without disturbing the caller's RNG stream.

    ``evaluate_accuracy`` re-seeds torch's global RNG; forking it keeps every seed's rollouts on their own
    stream instead of restarting all of them from the same state after each evaluation.
    """
    from trl_sae.demo.tasks import running_sum_reward
    from trl_sae.evaluation import evaluate_accuracy

    with torch.random.fork_rng(devices=[]):
        result = evaluate_accuracy(
            model,
            tokenizer,
            test_set,
            running_sum_reward,
            max_new_tokens=settings.response_length,
            batch_size=max(1, min(len(test_set), 100)),
        )
    return float(result["accuracy"])


@dataclass
class RunResult:
    """One (estimator, seed) run: its learning curve and per-step training statistics."""

    estimator: str
    seed: int
    eval_steps: list[int]
    eval_accuracy: list[float]
    train: dict[str, list[float]]
    seconds: float


# Per-step training statistics kept from the trainer's log history (documented keys).
TRAIN_KEYS = (
    "reward/mean",
    "completions/mean_length",
    "segments/boundaries_per_completion",
    "segments/mean_length",
    "critic/explained_variance",
    "policy/entropy",
    "timing/rollout_s",
    "timing/update_s",
)


class HeldOutEvaluation(TrainerCallback):
    """Held-out accuracy every ``settings.eval_every`` steps (and after the last), with a progress line."""

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer: Any,
        test_set: Any,
        settings: Settings,
        label: str,
        warm_start_accuracy: float,
    ) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.test_set = test_set
        self.settings = settings
        self.label = label
        # Step 0 is the shared warm start, measured once for all runs.
        self.steps: list[int] = [0]
        self.accuracy: list[float] = [warm_start_accuracy]
        self.start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step % self.settings.eval_every and step != state.max_steps:
            return
        accuracy = held_out_accuracy(self.policy, self.tokenizer, self.test_set, self.settings)
        self.steps.append(step)
        self.accuracy.append(accuracy)
        self.pending_print = True

    # The step's training metrics are logged after on_step_end (as in transformers): print them with it here.
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not getattr(self, "pending_print", False) or not logs or "reward/mean" not in logs:
            return
        self.pending_print = False
        step, accuracy, last = self.steps[-1], self.accuracy[-1], logs
        print(
            f"{self.label} step {step:>3}/{state.max_steps}  held-out acc {accuracy:.3f}  "
            f"train reward {last.get('reward/mean', math.nan):.3f}  "
            f"boundaries/completion {last.get('segments/boundaries_per_completion', math.nan):.1f}  "
            f"len {last.get('completions/mean_length', math.nan):.0f}  "
            f"({time.perf_counter() - self.start:.0f} s)",
            flush=True,
        )


def run_one(
    estimator: str,
    seed: int,
    settings: Settings,
    warm_start_dir: Path,
    splits: Any,
    tokenizer: Any,
    warm_start_accuracy: float,
    scratch_dir: Path,
    keep_models: bool = False,
) -> tuple[RunResult, Any]:
    """Train one estimator from the warm start for ``settings.steps`` steps, evaluating every ``eval_every``.

    Returns the run's result and, if ``keep_models``, the trainer (for the correlation analysis).
    """
    from transformers import AutoModelForCausalLM

    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tasks import running_sum_reward

    test_set = splits["test"].select(range(min(settings.eval_size, len(splits["test"]))))
    policy = AutoModelForCausalLM.from_pretrained(warm_start_dir)
    fields = sweep.ppo_fields(
        settings,
        scratch_dir / f"{estimator}-seed{seed}",
        seed,
        max_steps=settings.steps,
        response_length=settings.response_length,
        value_warmup_steps=settings.value_warmup_steps,
    )
    fields.update(estimator_overrides(estimator, settings))
    trainer = SAEPPOTrainer(
        model=policy,
        reward_funcs=running_sum_reward,
        args=SAEPPOConfig(**fields),
        train_dataset=splits["train"],
        processing_class=tokenizer,
    )
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    evaluator = HeldOutEvaluation(
        unwrapped.policy, tokenizer, test_set, settings, f"[{estimator} seed {seed}]", warm_start_accuracy
    )
    seconds, _ = sweep.train(trainer, evaluator)
    train = sweep.train_metrics(trainer, TRAIN_KEYS)
    result = RunResult(estimator, seed, evaluator.steps, evaluator.accuracy, train, seconds)
    return result, (trainer if keep_models else None)


# --------------------------------------------------------------------------------------------------
# Summaries, tables, figures
# --------------------------------------------------------------------------------------------------
# Shared with the other benchmarks (kept under these names for the scripts and tests that use them).
steps_to_threshold = common.steps_to_threshold
_mean_std = common.mean_std


def summarise(runs: Sequence[RunResult], settings: Settings, threshold: float) -> list[dict[str, Any]]:
    """One row per estimator: final / mean-over-curve accuracy, steps to ``threshold``, segment statistics."""
    rows = []
    for estimator in settings.estimators:
        mine = [r for r in runs if r.estimator == estimator]
        if not mine:
            continue
        curves = common.curve_summary([(r.eval_steps, r.eval_accuracy) for r in mine], threshold, "accuracy")
        # Mean accuracy over the evaluations after step 0: the area under the learning curve, a
        # sample-efficiency summary less sensitive to the last evaluation's noise than the final value.
        auc_mean, auc_std = _mean_std([float(np.mean(r.eval_accuracy[1:])) for r in mine])
        # The training prompts of a run are never repeated (steps x prompts < train split), so the reward of
        # the last steps is the sampled (temperature) accuracy on unseen prompts: a second, smoother view.
        late_mean, late_std = _mean_std([float(np.mean(r.train["reward/mean"][-5:])) for r in mine])
        boundaries = [float(np.nanmean(r.train["segments/boundaries_per_completion"])) for r in mine]
        lengths = [float(np.nanmean(r.train["completions/mean_length"])) for r in mine]
        to_threshold = curves["steps_to_threshold_mean"]
        rows.append(
            {
                "estimator": estimator,
                "seeds": [r.seed for r in mine],
                **curves,
                "curve_mean_accuracy_mean": auc_mean,
                "curve_mean_accuracy_std": auc_std,
                "last5_train_reward_mean": late_mean,
                "last5_train_reward_std": late_std,
                "samples_to_threshold_mean": None
                if to_threshold is None
                else to_threshold * settings.batch_size,
                "mean_boundaries_per_completion": float(np.mean(boundaries)),
                "mean_completion_length": float(np.mean(lengths)),
                "seconds_per_run": float(np.mean([r.seconds for r in mine])),
            }
        )
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], settings: Settings, threshold: float) -> str:
    """The summary rows as a Markdown table."""
    lines = [
        f"| estimator | final held-out acc (mean ± std, {len(settings.seeds)} seeds) | per seed | "
        f"mean acc over curve | train reward, last 5 steps | steps to acc ≥ {threshold:.2f} (seeds reaching) | "
        "boundaries / completion | completion tokens | s / run |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        per_seed = ", ".join(f"{v:.3f}" for v in row["final_accuracy_per_seed"])
        if row["steps_to_threshold_mean"] is None:
            to_threshold = f"never (0/{len(row['seeds'])})"
        else:
            to_threshold = f"{row['steps_to_threshold_mean']:.1f} ({row['seeds_reaching_threshold']}/{len(row['seeds'])})"
        lines.append(
            f"| {row['estimator']} | {row['final_accuracy_mean']:.3f} ± {row['final_accuracy_std']:.3f} | "
            f"{per_seed} | {row['curve_mean_accuracy_mean']:.3f} ± {row['curve_mean_accuracy_std']:.3f} | "
            f"{row['last5_train_reward_mean']:.3f} ± {row['last5_train_reward_std']:.3f} | "
            f"{to_threshold} | {row['mean_boundaries_per_completion']:.1f} | "
            f"{row['mean_completion_length']:.1f} | {row['seconds_per_run']:.0f} |"
        )
    return "\n".join(lines)


def plot_learning_curves(runs: Sequence[RunResult], settings: Settings, threshold: float, path: Path) -> Path:
    """Held-out accuracy vs samples (mean line, min-max band over seeds) and training reward per step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    for estimator in settings.estimators:
        mine = [r for r in runs if r.estimator == estimator]
        if not mine:
            continue
        colour = COLOURS.get(estimator, "black")
        samples = np.asarray(mine[0].eval_steps) * settings.batch_size
        accuracy = np.asarray([r.eval_accuracy for r in mine])
        left.plot(samples, accuracy.mean(axis=0), "o-", color=colour, markersize=3, label=estimator)
        left.fill_between(samples, accuracy.min(axis=0), accuracy.max(axis=0), color=colour, alpha=0.15)
        reward = np.asarray([r.train["reward/mean"] for r in mine])
        # A 5-step moving average: one step's reward over a few dozen samples is mostly noise.
        width = min(5, reward.shape[1])
        kernel = np.ones(width) / width
        smoothed = np.asarray([np.convolve(row, kernel, mode="valid") for row in reward])
        steps = np.arange(width, reward.shape[1] + 1)
        right.plot(steps, smoothed.mean(axis=0), color=colour, label=estimator)
        right.fill_between(steps, smoothed.min(axis=0), smoothed.max(axis=0), color=colour, alpha=0.12)
    left.axhline(threshold, color="grey", linestyle=":", linewidth=1, label=f"threshold {threshold:.2f}")
    left.set_xlabel("training samples (completions)")
    left.set_ylabel("held-out greedy accuracy")
    left.set_title(f"Held-out accuracy (mean, min-max over {len(settings.seeds)} seeds)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.set_xlabel("PPO step")
    right.set_ylabel("training reward (5-step moving average)")
    right.set_title(f"Training reward ({settings.batch_size} completions / step)")
    right.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    # 110 dpi keeps the PNG well under the repository's 300 KB budget.
    figure.savefig(path, dpi=110)
    return path


def run_correlation(
    trainer: Any, splits: Any, tokenizer: Any, settings: Settings, output_dir: Path
) -> dict[str, Any]:
    """Section 5.3.2 on a trained critic: Pearson r of GAE(lambda grid) / SAE(p grid) / adaptive lambda with A*."""
    from trl_sae.demo.tasks import running_sum_reward

    stem = output_dir / "advantage_correlation"
    return sweep.run_correlation(
        trainer, splits["test"], tokenizer, running_sum_reward, settings, settings.response_length, stem
    )


def run_settings_fingerprint(settings: Settings) -> str:
    """A digest of every setting that shapes one run (not which seeds or estimators are swept)."""
    return sweep.run_fingerprint(asdict(settings), ("estimators", "seeds", "threshold", "correlation"))


def run_result_path(output_dir: Path, settings: Settings, estimator: str, seed: int) -> Path:
    """Where one finished run is kept, so an interrupted sweep resumes at the first missing run."""
    return output_dir / "runs" / f"{estimator}-seed{seed}-{run_settings_fingerprint(settings)}.json"


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sweep.add_sweep_arguments(parser, DEFAULT_OUTPUT_DIR, ESTIMATORS, "all;0 1 2")
    parser.add_argument("--variant", choices=("default", "long"), default=None, help="task variant")
    parser.add_argument(
        "--num-terms", nargs=2, type=int, default=None, metavar=("LO", "HI"), help="terms per problem"
    )
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start SFT steps")
    parser.add_argument("--response-length", type=int, default=None, help="max new tokens per completion")
    parser.add_argument("--critic-learning-rate", type=float, default=None)
    parser.add_argument("--teacher-error-rate", type=float, default=None)
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="accuracy for 'steps to threshold' (default: warm start + half the best final gain)",
    )
    parser.add_argument("--no-correlation", action="store_true", help="skip the advantage-correlation step")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The defaults (or the smoke settings) with the command-line overrides applied."""
    flags = (
        "variant",
        "num_terms",
        "sft_steps",
        "response_length",
        "critic_learning_rate",
        "teacher_error_rate",
    )
    settings = sweep.apply_overrides(
        smoke_settings() if args.smoke else Settings(), args, *flags, "threshold"
    )
    return replace(settings, correlation=False) if args.no_correlation else settings


def default_threshold(runs: Sequence[RunResult], warm_start_accuracy: float) -> float:
    """Warm start plus half of the best estimator's mean gain: a level every estimator could plausibly reach."""
    finals: dict[str, list[float]] = {}
    for run in runs:
        finals.setdefault(run.estimator, []).append(run.eval_accuracy[-1])
    best = max(float(np.mean(v)) for v in finals.values())
    return warm_start_accuracy + 0.5 * max(0.0, best - warm_start_accuracy)


quiet_libraries = common.quiet_libraries
torch_threads = common.torch_threads


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and write its outputs; returns the results dictionary (also saved as JSON)."""
    return common.run_script(argv, _SCRIPT, parse_args, settings_from_args, run_benchmark)


def run_benchmark(settings: Settings, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Warm start, every (seed, estimator) run, summaries, figures, correlation; write everything."""
    from transformers import AutoModelForCausalLM

    output_dir: Path = args.output_dir
    splits = make_splits(settings)
    with sweep.session(args, command, "sample_efficiency_") as session:
        tokenizer = session.tokenizer
        warm_dir, warm = build_warm_start(settings, splits, tokenizer, session.warm_root)
        warm_model = AutoModelForCausalLM.from_pretrained(warm_dir)
        test_set = splits["test"].select(range(min(settings.eval_size, len(splits["test"]))))
        warm["held_out_accuracy"] = held_out_accuracy(warm_model, tokenizer, test_set, settings)
        del warm_model
        print(
            f"warm start: {settings.sft_steps} SFT steps ({warm['seconds']:.0f} s"
            f"{', reused' if warm['reused'] else ''}), held-out greedy accuracy {warm['held_out_accuracy']:.3f}",
            flush=True,
        )

        def one(estimator: str, seed: int, keep: bool) -> tuple[RunResult, Any]:
            accuracy = warm["held_out_accuracy"]
            return run_one(
                estimator, seed, settings, warm_dir, splits, tokenizer, accuracy, session.scratch, keep
            )

        kept: dict[str, Any] = {}
        path = partial(run_result_path, output_dir, settings)
        payloads = sweep.run_estimators(settings, path, one, kept, args.commit)
        runs = [RunResult(**p["result"]) for p in payloads]
        threshold = (
            settings.threshold
            if settings.threshold is not None
            else default_threshold(runs, warm["held_out_accuracy"])
        )
        rows = summarise(runs, settings, threshold)
        table = markdown_table(rows, settings, threshold)
        plot_learning_curves(runs, settings, threshold, output_dir / "learning_curves.png")

        correlation = None
        if "trainer" in kept:
            print("advantage correlation on the SAE critic (first seed) ...", flush=True)
            correlation = run_correlation(kept.pop("trainer"), splits, tokenizer, settings, output_dir)
            print(correlation["table"], flush=True)

    results = {
        "command": command,
        "environment": session.env,
        "settings": asdict(settings),
        "samples_per_run": settings.steps * settings.batch_size,
        "warm_start": warm,
        "threshold": threshold,
        "summary": rows,
        "runs": [asdict(r) for r in runs],
        "correlation": None if correlation is None else correlation["result"],
        "correlation_seconds": None if correlation is None else correlation["seconds"],
        "total_seconds": session.seconds(),
    }
    print(table, flush=True)
    sweep.finish_sweep(output_dir, results, results_markdown(results, table, correlation))
    return results


def results_markdown(results: dict[str, Any], table: str, correlation: dict[str, Any] | None) -> str:
    """``results.md``: the table, the settings that matter, the command and the environment."""
    settings = results["settings"]
    warm = results["warm_start"]
    lines = [
        "# Sample efficiency on the running-sum task",
        "",
        f"Task variant `{settings['variant']}`; warm start: {settings['sft_steps']} SFT steps, held-out greedy "
        f"accuracy {warm['held_out_accuracy']:.3f} on {settings['eval_size']} prompts. Every run: "
        f"{settings['steps']} PPO steps x {settings['prompts_per_step']} prompts x "
        f"{settings['num_generations']} generations = {results['samples_per_run']} completions; actor lr "
        f"{settings['learning_rate']:g}, critic lr {settings['critic_learning_rate']:g}, temperature "
        f"{settings['temperature']:g}, {settings['num_ppo_epochs']} PPO epochs x "
        f"{settings['num_mini_batches']} mini-batches, value warm-up {settings['value_warmup_steps']} steps "
        f"(none for grpo), SAE p = {settings['segment_threshold']:g}, lam = {settings['lam']:g} (sae, gae).",
        "",
        table,
        "",
        "![learning curves](learning_curves.png)",
        "",
    ]
    if correlation is not None:
        lines += [
            "## Advantage correlation with Monte-Carlo A* (paper Section 5.3.2), SAE critic of the first seed",
            "",
            correlation["table"],
            "",
            "![advantage correlation](advantage_correlation.png)",
            "",
        ]
    lines += common.report_footer(results)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
