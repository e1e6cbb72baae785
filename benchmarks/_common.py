"""What the RL benchmarks share: environment, report writing, the warm-start cache, curves, paired statistics.

``sample_efficiency.py``, ``long_horizon.py``, ``critic_diagnosis.py``, ``known_error_critic.py`` and
``real_model_gym.py`` import this
module (it sits next to them; they put their folder on ``sys.path``). Nothing here knows a task: each script
keeps its task, its settings and its tables.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Offline and quiet before transformers / datasets / trl are imported by any benchmark.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from trl_sae.evaluation import mcnemar_exact  # the paired test, shared with `trl-sae eval`

__all__ = [
    "COLOURS",
    "Job",
    "cached_warm_start",
    "code_at_start",
    "code_version",
    "command_line",
    "curve_auc",
    "curve_summary",
    "environment",
    "finite",
    "fisher_power",
    "holm",
    "mcnemar_exact",
    "mean_std",
    "paired_difference",
    "quiet_libraries",
    "run_jobs",
    "save_json_atomically",
    "steps_to_threshold",
    "tee_to_log",
    "torch_threads",
]

# Fixed colours so every figure reads the same (SAE in red, as in the paper's figures).
COLOURS = {
    "sae": "#C44E52",
    "gae": "#4C72B0",
    "mc": "#55A868",
    "adaptive_lambda": "#8172B3",
    "grpo": "#DD8452",
}


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Versions, threads and machine load: enough to tell whether two result files are comparable."""
    import datasets
    import transformers
    import trl

    try:
        import peft

        peft_version = peft.__version__
    except ImportError:
        peft_version = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "datasets": datasets.__version__,
        "peft": peft_version,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": code_at_start()["commit"],  # the process's, as its result files name it
    }


# What a run's numbers depend on besides its settings: a change anywhere else (results, docs, tests) leaves two
# runs' code the same.
CODE_PATHS = ("trl_sae", "benchmarks/*.py", "pyproject.toml")


def code_version(root: Path | None = None) -> dict[str, Any]:
    """The code a run ran: ``{"commit": HEAD, "uncommitted": [changed tracked files under CODE_PATHS]}``.

    ``commit`` alone does not say it: a sweep can run from a checkout with edits not yet committed, and those
    files are listed (an empty list: the code is exactly ``commit``'s). Both are None outside a git checkout.
    """
    root = Path(__file__).resolve().parent if root is None else root
    # `top`: the pathspecs mean the same from any folder of the checkout
    pathspecs = [f":(top,glob){path}" for path in CODE_PATHS]

    def git(*arguments: str) -> str:
        return subprocess.run(
            ["git", *arguments], capture_output=True, text=True, check=True, cwd=root
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git(
            "-c", "core.quotePath=false", "status", "--porcelain", "--untracked-files=no", "--", *pathspecs
        )
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "uncommitted": None}
    return {"commit": commit, "uncommitted": sorted(line[3:] for line in status.splitlines() if line.strip())}


@functools.cache
def code_at_start() -> dict[str, Any]:
    """:func:`code_version` as of this process's first call, which a benchmark makes before it runs anything: a
    sweep runs for hours, and the code it imported is what its result files must name, not a commit or an edit
    made in the checkout meanwhile."""
    return code_version()


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Silence warnings, transformers' logging and progress bars; restore them afterwards.

    Library chatter (generation notices, weight-loading bars) would bury the per-run progress lines, and the
    benchmarks also run inside pytest, whose process must get its settings back.
    """
    import datasets
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_bars = hf_logging.is_progress_bar_enabled()
    datasets_bars = datasets.is_progress_bar_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        datasets.disable_progress_bars()
        try:
            yield
        finally:
            hf_logging.set_verbosity(verbosity)
            if hf_bars:
                hf_logging.enable_progress_bar()
            if datasets_bars:
                datasets.enable_progress_bars()


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run with ``num_threads`` intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------------
# Report writing
# --------------------------------------------------------------------------------------------------
def command_line(argv: Sequence[str] | None, script: str) -> str:
    """The exact command: as typed for a script run, reconstructed for an in-process call (tests)."""
    return shlex.join(["python", *sys.argv] if argv is None else ["python", script, *argv])


class _Tee:
    """Write to the console and to a log file at once."""

    def __init__(self, stream: Any, log: Any) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()


@contextmanager
def tee_to_log(path: Path) -> Iterator[None]:
    """Print to the console and to ``path`` (``run.log``) while inside; stdout is restored afterwards."""
    stdout = sys.stdout
    with open(path, "w", encoding="utf-8") as log:
        sys.stdout = _Tee(stdout, log)
        try:
            yield
        finally:
            sys.stdout = stdout


def run_script(
    argv: Sequence[str] | None,
    script: str,
    parse_args: Callable[[Sequence[str] | None], Any],
    settings_from_args: Callable[[Any], Any],
    run: Callable[[Any, Any, str], dict[str, Any]],
) -> dict[str, Any]:
    """The ``main`` of a benchmark script: parse, then ``run(settings, args, command)`` with the output folder
    made, the log teed to ``run.log``, libraries quiet and ``--num-threads`` intra-op threads.

    ``command`` is the exact command, as typed for a script run and reconstructed for an in-process call.
    """
    args = parse_args(argv)
    settings = settings_from_args(args)
    command = command_line(argv, script)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    with tee_to_log(args.output_dir / "run.log"), quiet_libraries(), torch_threads(args.num_threads):
        return run(settings, args, command)


def report_footer(results: dict[str, Any]) -> list[str]:
    """The closing lines of a sweep's results.md: the command that produced it, its wall time and environment."""
    return [
        "## Command",
        "",
        "```",
        results["command"],
        "```",
        "",
        f"Total wall time {results['total_seconds']:.0f} s.",
        "",
        "## Environment",
        "",
        "```json",
        json.dumps(results["environment"], indent=1),
        "```",
        "",
    ]


def finite(value: Any) -> Any:
    """NaN and infinities as None, recursively: strict JSON has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def save_json_atomically(path: Path, payload: Any) -> None:
    """Write ``payload`` as JSON through a staging file, so a crash mid-write leaves no half file to be reused.

    Python's json round-trips NaN (a step without a metric), which the summaries expect as a float.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    staging.replace(path)


# --------------------------------------------------------------------------------------------------
# The one resumable runner of every sweep
# --------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """One run of a sweep: ``run()`` returns its JSON payload, kept at ``path``.

    ``force``: run it even when ``path`` exists (a run whose live objects the sweep needs afterwards).
    """

    label: str
    path: Path
    run: Callable[[], dict[str, Any]]
    force: bool = False


def git_commit_file(path: Path, message: str, attempts: int = 20) -> None:
    """Commit ``path`` alone (staged with ``-f``: results folders may be ignored), whatever else is staged.

    Two sweep processes on disjoint seeds share one checkout, so one may find the other's ``index.lock``: that
    is retried (a second apart), any other git failure raises with git's message.
    """
    path = (
        path.resolve()
    )  # git runs in the file's folder: a path relative to ours would not be found from there
    cwd = path.parent
    commands = (
        ["git", "add", "-f", "--", path.name],
        ["git", "commit", "--only", "-m", message, "--", path.name],
    )
    for command in commands:
        for attempt in range(attempts):
            result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
            if result.returncode == 0:
                break
            if "index.lock" not in result.stderr or attempt == attempts - 1:
                raise RuntimeError(f"{' '.join(command[:2])} failed for {path}: {result.stderr.strip()}")
            time.sleep(1.0)


def run_jobs(jobs: Sequence[Job], commit: bool = False) -> list[dict[str, Any]]:
    """Run a sweep's jobs in order and return their payloads; resumable across processes and sessions.

    A job whose ``path`` exists is reused (its payload read back, nothing run) unless ``force``; a finished one
    is written atomically (a crash leaves no half file) and, with ``commit``, git-committed on its own, so a
    sweep can be completed in several sittings. One progress line per job: done or reused, seconds, and the
    estimated time left (mean seconds of the jobs run here x jobs to go).
    """
    payloads: list[dict[str, Any]] = []
    ran: list[float] = []
    for index, job in enumerate(jobs, start=1):
        prefix = f"[{index}/{len(jobs)}] {job.label}"
        if job.path.exists() and not job.force:
            payloads.append(json.loads(job.path.read_text()))
            print(f"{prefix}: reused {job.path}", flush=True)
            continue
        start = time.perf_counter()
        payload = job.run()
        save_json_atomically(job.path, payload)
        if commit:
            git_commit_file(job.path, f"benchmarks: {job.label} finished ({job.path.name})")
        ran.append(time.perf_counter() - start)
        left = sum(1 for j in jobs[index:] if j.force or not j.path.exists())
        print(
            f"{prefix}: done in {ran[-1]:.0f} s{' (committed)' if commit else ''}; "
            f"~{left * sum(ran) / len(ran) / 60:.0f} min left for {left} runs",
            flush=True,
        )
        payloads.append(payload)
    return payloads


# --------------------------------------------------------------------------------------------------
# Warm-start cache
# --------------------------------------------------------------------------------------------------
def cached_warm_start(
    root: Path, name: str, fingerprint: dict[str, Any], build: Callable[[Path], dict[str, Any]]
) -> tuple[Path, dict[str, Any]]:
    """The warm start under ``root/<name>-<digest of fingerprint>``: reused when its saved fingerprint matches,
    else ``build(directory)`` (which saves the model there and returns extra facts, e.g. its final loss).

    Returns the directory and ``{"settings", "seconds", "reused", "path", **extra}``.
    """
    fingerprint = json.loads(json.dumps(fingerprint))  # tuples compare equal to the saved lists
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    directory = root / f"{name}-{digest}"
    marker = directory / "warm_start_settings.json"
    if marker.exists() and json.loads(marker.read_text()) == fingerprint:
        return directory, {"settings": fingerprint, "seconds": 0.0, "reused": True, "path": str(directory)}
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    extra = build(directory)
    marker.write_text(json.dumps(fingerprint, indent=2) + "\n")  # last: a half-built model is never reused
    info = {
        "settings": fingerprint,
        "seconds": time.perf_counter() - start,
        "reused": False,
        "path": str(directory),
    }
    return directory, {**info, **extra}


# --------------------------------------------------------------------------------------------------
# Curves and paired statistics
# --------------------------------------------------------------------------------------------------
def steps_to_threshold(steps: Sequence[int], values: Sequence[float], threshold: float) -> int | None:
    """The first evaluated step whose value is at least ``threshold`` (None if never)."""
    for step, value in zip(steps, values):
        if value >= threshold:
            return int(step)
    return None


def curve_summary(
    curves: Sequence[tuple[Sequence[int], Sequence[float]]], threshold: float, name: str
) -> dict[str, Any]:
    """Over seeds' learning curves ``(steps, values)``: the final ``name`` (mean, std, per seed) and the steps
    to reach ``threshold`` (per seed, mean over the seeds that reach it, how many do)."""
    finals = [float(values[-1]) for _, values in curves]
    final_mean, final_std = mean_std(finals)
    reached = [steps_to_threshold(steps, values, threshold) for steps, values in curves]
    hit = [s for s in reached if s is not None]
    return {
        f"final_{name}_mean": final_mean,
        f"final_{name}_std": final_std,
        f"final_{name}_per_seed": finals,
        "steps_to_threshold_per_seed": reached,
        "steps_to_threshold_mean": float(np.mean(hit)) if hit else None,
        "seeds_reaching_threshold": len(hit),
    }


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1) over seeds; a single seed has no spread to report (std 0)."""
    array = np.asarray(values, dtype=float)
    return float(array.mean()), float(array.std(ddof=1)) if array.size > 1 else 0.0


def curve_auc(steps: Sequence[int], values: Sequence[float]) -> float:
    """Area under a curve per step (trapezoids, step 0 included): the mean value over training."""
    steps_array = np.asarray(steps, dtype=float)
    if steps_array.size < 2 or steps_array[-1] == steps_array[0]:
        return float(values[-1])
    return float(
        np.trapezoid(np.asarray(values, dtype=float), steps_array) / (steps_array[-1] - steps_array[0])
    )


def paired_difference(
    a: Sequence[float], b: Sequence[float], num_bootstrap: int = 2000, seed: int = 0, confidence: float = 0.95
) -> dict[str, Any]:
    """Mean of the per-seed differences ``a - b`` with a t interval and a bootstrap (over seeds) interval.

    With one seed there is no spread: both intervals are NaN.
    """
    from scipy import stats

    diffs = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n = diffs.size
    mean = float(diffs.mean())
    nan = float("nan")
    if n < 2:
        return {
            "mean": mean,
            "per_seed": diffs.tolist(),
            "t_ci": [nan, nan],
            "bootstrap_ci": [nan, nan],
            "n": n,
        }
    sem = float(diffs.std(ddof=1) / math.sqrt(n))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sem
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, n, size=(num_bootstrap, n))].mean(axis=1)
    alpha = (1 - confidence) / 2
    return {
        "mean": mean,
        "per_seed": diffs.tolist(),
        "t_ci": [mean - half, mean + half],
        "bootstrap_ci": [float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))],
        "n": n,
    }


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (family-wise error control, any dependence between the tests)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [1.0] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def fisher_power(p1: float, p2: float, n: int, alpha: float = 0.05) -> float:
    """Exact power of the two-sided Fisher exact test of ``n`` vs ``n`` runs when the true rates are ``p1``, ``p2``.

    The sum over every outcome ``(x1, x2)`` of its binomial probability where scipy's Fisher test rejects.
    """
    from scipy import stats

    power = 0.0
    for x1 in range(n + 1):
        for x2 in range(n + 1):
            if stats.fisher_exact([[x1, n - x1], [x2, n - x2]]).pvalue <= alpha:
                power += stats.binom.pmf(x1, n, p1) * stats.binom.pmf(x2, n, p2)
    return float(power)
