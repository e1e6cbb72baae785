"""What the PPO sweeps share around the runner: a run's trainer settings and metrics, its file name, the
correlation analysis of a kept run, and a sweep's opening and closing writes.

``sample_efficiency.py``, ``long_horizon.py`` and ``known_error_critic.py`` train one trl-sae run per job of
:func:`_common.run_jobs`; this module holds what their job bodies and sweep bodies had written three times.
Nothing here knows a task: the scripts pass their reward, data and file names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import _common as common

__all__ = [
    "ESTIMATORS",
    "SMOKE_SIZES",
    "PPOSettings",
    "Session",
    "add_sweep_arguments",
    "apply_overrides",
    "finish_sweep",
    "kept_trainer_payload",
    "ppo_fields",
    "run_correlation",
    "run_estimators",
    "run_fingerprint",
    "session",
    "start_sweep",
    "train",
    "train_metrics",
    "warm_start",
    "warm_start_fingerprint",
]


ESTIMATORS = ("sae", "gae", "mc", "adaptive_lambda", "grpo")


@dataclass
class PPOSettings:
    """The RL settings every sweep has, identical for every estimator except the estimator itself; a sweep's
    ``Settings`` adds its task and model and overrides the defaults that differ.

    The defaults are the sample-efficiency benchmark's: the offline demo's values (``trl_sae.demo.run``), tuned
    there for a held-out gain on the running-sum task.
    """

    estimators: tuple[str, ...] = ESTIMATORS
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 40
    prompts_per_step: int = 8
    num_generations: int = 8
    temperature: float = 1.0
    learning_rate: float = 1e-4
    critic_learning_rate: float = 3e-3
    num_ppo_epochs: int = 2
    num_mini_batches: int = 2
    value_warmup_steps: int = 0
    segment_threshold: float = 0.2
    lam: float = 0.95
    # Evaluation
    eval_every: int = 5
    eval_size: int = 200
    threshold: float | None = None
    # Advantage correlation (Section 5.3.2) on the first seed's SAE critic
    correlation: bool = True
    # Sized from a first run: 32 trajectories gave 128 spans of ~3.5 tokens and 95% intervals ~0.6 wide.
    corr_trajectories: int = 256
    corr_spans: int = 4
    corr_continuations: int = 32
    corr_bootstrap: int = 1000

    @property
    def batch_size(self) -> int:
        """Completions per PPO step (the sample budget per step)."""
        return self.prompts_per_step * self.num_generations


# A sweep's --smoke: every stage on tiny data, model, warm start, PPO budget and correlation, in seconds (not a
# result). Each script adds its own task's sizes.
# fmt: off
SMOKE_SIZES: dict[str, Any] = {
    "n_train": 64, "n_test": 8, "hidden_size": 32, "num_layers": 1, "num_heads": 2,  # data and model
    "sft_steps": 4, "sft_batch_size": 8,  # warm start
    "seeds": (0,), "steps": 2, "prompts_per_step": 2, "num_generations": 2,  # PPO budget
    "num_ppo_epochs": 1, "num_mini_batches": 1, "eval_every": 1,
    "corr_trajectories": 2, "corr_spans": 1, "corr_continuations": 2, "corr_bootstrap": 20,  # correlation
}
# fmt: on


def ppo_fields(
    settings: Any,
    output_dir: Path,
    seed: int,
    *,
    max_steps: int,
    response_length: int,
    value_warmup_steps: int,
) -> dict[str, Any]:
    """The ``SAEPPOConfig`` fields every sweep run shares: its batch, budget and PPO settings, CPU, no saving.

    ``settings`` is a sweep's settings dataclass (``batch_size``, ``num_generations``, the learning rates, ...).
    """
    return {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": settings.batch_size,
        "num_generations": settings.num_generations,
        "max_steps": max_steps,
        "response_length": response_length,
        "temperature": settings.temperature,
        "learning_rate": settings.learning_rate,
        "critic_learning_rate": settings.critic_learning_rate,
        # A constant rate: with a decaying schedule, a short run's late steps would barely move.
        "lr_scheduler_type": "constant",
        "num_ppo_epochs": settings.num_ppo_epochs,
        "num_mini_batches": settings.num_mini_batches,
        "value_warmup_steps": value_warmup_steps,
        "segment_threshold": settings.segment_threshold,
        "lam": settings.lam,
        "seed": seed,
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "use_cpu": True,
    }


def train(trainer: Any, *callbacks: Any) -> tuple[float, float]:
    """Train with ``callbacks`` (and without the per-step metric printer); returns wall and CPU seconds.

    The CPU time is this process's: on a shared machine the wall time also counts other people's jobs.
    """
    from transformers.trainer_callback import PrinterCallback

    # The sweeps print one progress line per evaluation; the per-step metric dicts would drown it.
    trainer.remove_callback(PrinterCallback)
    for callback in callbacks:
        trainer.add_callback(callback)
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    return time.perf_counter() - start, time.process_time() - cpu_start


def train_metrics(trainer: Any, keys: Iterable[str]) -> dict[str, list[float]]:
    """Per-step training statistics ``keys`` from the trainer's log history (NaN where a step lacks one)."""
    logs = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    return {key: [float(entry.get(key, math.nan)) for entry in logs] for key in keys}


def run_fingerprint(data: dict[str, Any], swept: Iterable[str]) -> str:
    """A 12-digit digest of a run's settings ``data`` without the ``swept`` keys and the ``corr*`` ones.

    What is swept (seeds, arms) is in the run's file name instead, and the correlation analysis runs after the
    run, so neither makes a run different. The digest names finished runs on disk: changing it reruns them.
    """
    data = dict(data)
    for key in [*swept, *(key for key in data if key.startswith("corr"))]:
        data.pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def kept_trainer_payload(
    kept: dict[str, Any], settings: Any, run: Callable[[], tuple[Any, Any]]
) -> dict[str, Any]:
    """A job body: ``run()`` gives (result dataclass, trainer or None); a trainer is kept in ``kept`` for the
    correlation analysis after the sweep, the payload is ``{"settings", "result"}``."""
    result, trainer = run()
    if trainer is not None:
        kept["trainer"] = trainer
    return {"settings": asdict(settings), "result": asdict(result)}


def run_estimators(
    settings: Any,
    path: Callable[[str, int], Path],
    run: Callable[[str, int, bool], tuple[Any, Any]],
    kept: dict[str, Any],
    commit: bool,
    label: str = "",
) -> list[dict[str, Any]]:
    """Every (seed, estimator) run of ``settings`` through the resumable runner, seed-major; their payloads.

    ``run(estimator, seed, keep=...)`` trains one run; ``path(estimator, seed)`` is where it is kept. With
    ``settings.correlation`` the first seed's SAE run is rerun (its JSON exists after a first sitting) and its
    trainer kept in ``kept``: the correlation analysis needs its live critic and policy.
    """
    jobs = []
    for seed in settings.seeds:
        for estimator in settings.estimators:
            keep = settings.correlation and estimator == "sae" and seed == settings.seeds[0]
            body = partial(kept_trainer_payload, kept, settings, partial(run, estimator, seed, keep=keep))
            jobs.append(
                common.Job(f"{label}{estimator} seed {seed}", path(estimator, seed), body, force=keep)
            )
    return common.run_jobs(jobs, commit=commit)


def run_correlation(
    trainer: Any,
    dataset: Any,
    tokenizer: Any,
    reward: Callable[..., Any],
    settings: Any,
    max_new_tokens: int,
    stem: Path,
) -> dict[str, Any]:
    """The paper's Section 5.3.2 on a trained critic: Pearson r of GAE(lambda grid) / SAE(p grid) / adaptive
    lambda with the Monte-Carlo A*; written to ``stem`` ``.json`` and ``.png``."""
    from trl_sae.analysis import correlate_advantages, critic_value_fn, plot_correlations

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    start = time.perf_counter()
    result = correlate_advantages(
        unwrapped.policy,
        tokenizer,
        dataset,
        reward,
        critic_value_fn(unwrapped.critic),
        num_trajectories=settings.corr_trajectories,
        num_spans_per_trajectory=settings.corr_spans,
        num_continuations=settings.corr_continuations,
        # The training temperature: A* is the advantage under the policy the critic was trained for.
        temperature=settings.temperature,
        max_new_tokens=max_new_tokens,
        sae_lam=settings.lam,
        seed=0,
        batch_size=128,
        span_p=settings.segment_threshold,
        num_bootstrap=settings.corr_bootstrap,
        show_progress=False,
    )
    seconds = time.perf_counter() - start
    result.to_json(str(stem.with_suffix(".json")))
    plot_correlations(result, stem.with_suffix(".png"))
    return {"table": result.to_markdown(), "result": result.to_dict(), "seconds": seconds}


def start_sweep(output_dir: Path, command: str) -> dict[str, Any]:
    """A sweep's first writes: ``command.txt`` and the command and environment printed; returns the environment."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "command.txt").write_text(command + "\n")
    env = common.environment()
    print(f"command: {command}", flush=True)
    print(f"environment: {json.dumps(env)}", flush=True)
    return env


def finish_sweep(output_dir: Path, results: dict[str, Any], markdown: str) -> None:
    """A sweep's last writes: ``results.json`` (strict JSON, atomically) and ``results.md`` (the tables and the
    footer of :func:`_common.report_footer`)."""
    common.save_json_atomically(output_dir / "results.json", common.finite(results))
    (output_dir / "results.md").write_text(markdown)
    print(f"total {results['total_seconds']:.0f} s; outputs in {output_dir}", flush=True)


@dataclass
class Session:
    """What every walk or running-sum sweep opens with: its environment, start time, the character tokenizer, a
    scratch folder (trainer outputs) and the warm-start cache (``--warm-start-dir``, else inside the scratch)."""

    env: dict[str, Any]
    started: float
    tokenizer: Any
    scratch: Path
    warm_root: Path

    def seconds(self) -> float:
        """Wall time since the sweep started."""
        return time.perf_counter() - self.started


@contextmanager
def session(args: Any, command: str, prefix: str) -> Iterator[Session]:
    """Open a sweep into ``args.output_dir`` (:func:`start_sweep`); the scratch folder is removed on leaving."""
    from trl_sae.demo.tiny import build_char_tokenizer

    env = start_sweep(args.output_dir, command)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    warm_root = args.warm_start_dir if args.warm_start_dir is not None else scratch / "warm"
    try:
        yield Session(env, started, build_char_tokenizer(), scratch, warm_root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def add_sweep_arguments(
    parser: argparse.ArgumentParser,
    default_output_dir: Path,
    estimators: Iterable[str],
    defaults: str,
    steps_help: str = "PPO steps per run",
) -> None:
    """The flags every PPO sweep has (which runs, their budget, where results and warm starts go, ``--commit``);
    ``defaults`` names the default estimators and seeds in the help."""
    estimators_default, seeds_default = defaults.split(";")
    parser.add_argument(
        "--smoke", action="store_true", help="every stage on tiny sizes, in seconds (not a result)"
    )
    parser.add_argument(
        "--estimators",
        nargs="+",
        choices=tuple(estimators),
        default=None,
        help=f"default: {estimators_default}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help=f"default: {seeds_default}")
    parser.add_argument("--steps", type=int, default=None, help=steps_help)
    parser.add_argument("--prompts-per-step", type=int, default=None)
    parser.add_argument("--num-generations", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None, help="actor learning rate")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every this many steps")
    parser.add_argument("--output-dir", type=Path, default=default_output_dir)
    parser.add_argument(
        "--warm-start-dir",
        type=Path,
        default=None,
        help="warm starts are cached here by fingerprint, reused when their settings match (default: a temp dir)",
    )
    parser.add_argument(
        "--num-threads", type=int, default=1, help="torch intra-op threads (1 is fastest for tiny models)"
    )
    parser.add_argument("--commit", action="store_true", help="git-commit each finished run's JSON")


# The settings every sweep's command line can override (add_sweep_arguments' flags).
SWEEP_FLAGS = (
    "estimators",
    "seeds",
    "steps",
    "prompts_per_step",
    "num_generations",
    "learning_rate",
    "eval_every",
)


def apply_overrides(settings: Any, args: argparse.Namespace, *flags: str) -> Any:
    """``settings`` with the flags of :func:`add_sweep_arguments` and a script's own ``flags`` that were given
    (named as the settings' fields; a list value becomes a tuple, as the settings hold them)."""
    given = {name: getattr(args, name) for name in (*SWEEP_FLAGS, *flags)}
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    settings = replace(settings, **overrides)
    if settings.steps < 1 or settings.eval_every < 1:
        raise SystemExit("--steps and --eval-every must be >= 1.")
    return settings


# The settings of a tiny model's supervised warm start that every task shares (its data and model, the SFT).
WARM_START_KEYS = ("n_train", "teacher_error_rate", "data_seed", "hidden_size", "num_layers", "num_heads")
WARM_START_KEYS += ("sft_learning_rate", "sft_batch_size")


def warm_start_fingerprint(settings: Any, sft_steps: int, **task: Any) -> dict[str, Any]:
    """What determines a warm start: the shared keys, its SFT budget and the ``task``'s own settings
    (JSON-normalised, so tuples equal saved lists)."""
    data = {key: getattr(settings, key) for key in WARM_START_KEYS}
    return json.loads(json.dumps({**data, "sft_steps": sft_steps, **task}))


def warm_start(
    settings: Any, splits: Any, tokenizer: Any, root: Path, name: str, fingerprint: dict[str, Any]
) -> tuple[Path, dict[str, Any]]:
    """A tiny Qwen3 SFT-trained on ``splits["train"]`` once per ``fingerprint`` under ``root/<name>-<hash>``,
    reused while its saved fingerprint matches (:func:`_common.cached_warm_start`).

    Returns its folder and a description (settings, wall time, whether reused, the final SFT loss).
    """
    from trl_sae.demo.tiny import build_tiny_qwen3
    from trl_sae.demo.warmstart import sft_warm_start

    def build(directory: Path) -> dict[str, Any]:
        model = build_tiny_qwen3(
            tokenizer,
            hidden_size=settings.hidden_size,
            num_layers=settings.num_layers,
            num_heads=settings.num_heads,
            seed=settings.data_seed,
        )
        losses: list[float] = []
        sft_warm_start(
            model,
            tokenizer,
            splits["train"],
            max_steps=fingerprint["sft_steps"],
            learning_rate=settings.sft_learning_rate,
            batch_size=settings.sft_batch_size,
            seed=settings.data_seed,
            progress=False,
            callback=lambda step, loss: losses.append(loss),
        )
        model.save_pretrained(directory)
        return {"final_sft_loss": float(sum(losses[-20:]) / len(losses[-20:])) if losses else math.nan}

    return common.cached_warm_start(root, name, fingerprint, build)
