"""Process-memory readings and measurement subprocesses, shared by the memory benchmarks.

``bench_memory.py``, ``bench_trainer.py``, ``bench_logprobs_memory.py`` and ``bench_step_memory.py`` measure
peak RSS in a fresh process per configuration. Standard library only: a worker imports this before its own
training stack, so it adds nothing to the memory it measures.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "mem_available",
    "peak_bytes",
    "reset_peak",
    "rss_bytes",
    "ru_maxrss_bytes",
    "run_worker",
    "status_bytes",
    "with_source",
]


def _proc_field_bytes(path: str, field: str) -> int | None:
    """A ``Field:  N kB`` line of a /proc file, in bytes; None where the file or the field is missing."""
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def status_bytes(field: str) -> int | None:
    """``field`` of /proc/self/status (``VmRSS``: resident now, ``VmHWM``: its peak), in bytes."""
    return _proc_field_bytes("/proc/self/status", field)


def mem_available() -> int | None:
    """The kernel's estimate of memory available to a new process (/proc/meminfo), in bytes."""
    return _proc_field_bytes("/proc/meminfo", "MemAvailable")


def ru_maxrss_bytes() -> int:
    """This process's peak RSS since it started (getrusage reports bytes on macOS, kB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """Resident memory now (the peak so far where /proc is missing)."""
    current = status_bytes("VmRSS")
    return current if current is not None else ru_maxrss_bytes()


def peak_bytes() -> int:
    """Peak resident memory since start or since the last :func:`reset_peak`."""
    peak = status_bytes("VmHWM")
    return peak if peak is not None else ru_maxrss_bytes()


def reset_peak() -> bool:
    """Make the kernel's peak counter (VmHWM) start again from the current RSS; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def run_worker(
    command: Sequence[str], label: str, env: Mapping[str, str] | None = None, result_file: str | None = None
) -> Any:
    """Run ``command`` (a measurement in a fresh process) and return its JSON result: the contents of
    ``result_file`` when given, else its last stdout line. A failed worker raises with ``label`` and the tail of
    its stderr."""
    completed = subprocess.run(list(command), capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{completed.stderr[-4000:]}")
    if result_file is not None:
        with open(result_file) as handle:
            return json.load(handle)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def with_source(source: str | None) -> dict[str, str]:
    """This environment with ``source`` (a checkout) first on PYTHONPATH, so a worker imports its ``trl_sae``."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
    return env
