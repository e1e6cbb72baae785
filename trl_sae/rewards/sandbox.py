"""Run untrusted, model-written Python programs against tests in a sandbox (Linux).

Each program runs in a fresh sandbox started by :meth:`Sandbox.run`: a launcher process
(:mod:`trl_sae.rewards._sandbox_launcher`, started with an empty environment in a new session) that, as
root, enters new pid, network, mount, IPC and UTS namespaces, mounts a private ``/proc`` and private
tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm``, hides the trainer's files (``hide_paths``) and runs
each test in a forked child that switches to an unprivileged uid of its own and sets CPU, address-space,
process, open-file and file-size limits before the program's first line. Expected outputs never enter
the sandbox: the harness reports a digest of each test's (normalized) output, which is compared here.
With ``backend="bwrap"``, bubblewrap builds the namespaces and an almost empty file system instead
(:mod:`trl_sae.rewards._bwrap`), and the same launcher runs inside as their pid 1.
What this does and does not protect against is in docs/guides/code.md.

This module imports only the standard library (and the package's standard-library-only ``_bwrap``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import numbers
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_sae.rewards._bwrap import BACKENDS, bwrap_argv, bwrap_unusable, find_bwrap, read_child_pid

__all__ = [
    "BACKENDS",
    "SLOTS_PER_PROCESS",
    "IsolationUnavailableError",
    "RunResult",
    "Sandbox",
    "SandboxLimits",
    "find_sandbox_processes",
]

logger = logging.getLogger(__name__)

_LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))

# Environment of the sandboxed program: nothing of the trainer's (no tokens, no HF_* variables).
_CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class IsolationUnavailableError(RuntimeError):
    """The sandbox could not isolate the program as required (e.g. not root); the message says what to do."""


def _positive(name: str, value: Any, integer: bool = False) -> None:
    ok = (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
    if integer:
        ok = ok and isinstance(value, numbers.Integral)
    if not ok:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"`{name}` must be {kind}, got {value!r}.")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed program.

    Attributes:
        cpu_seconds: CPU time per test (all threads together; RLIMIT_CPU, rounded up to whole seconds).
        wall_seconds: wall-clock time per test; the test's process group is killed after it.
        completion_seconds: wall-clock time for all tests of one program; tests not started by then are
            reported ``not_run``, and the whole sandbox is killed shortly after.
        memory_mb: address space per process (RLIMIT_AS).
        processes: processes and threads of the sandbox's uid together (RLIMIT_NPROC; needs the
            privilege drop, i.e. root).
        open_files: open file descriptors per process (RLIMIT_NOFILE).
        file_mb: the largest file a program may write (RLIMIT_FSIZE); its stdout is such a file, so this
            also caps the output. Exceeding it kills the program (verdict ``file_size_limit``).
        tmpfs_mb: size of the private tmpfs that holds the program's working directory and ``/tmp``.
    """

    cpu_seconds: float = 2.0
    wall_seconds: float = 4.0
    completion_seconds: float = 30.0
    memory_mb: int = 1024
    processes: int = 16
    open_files: int = 64
    file_mb: float = 16.0
    tmpfs_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "completion_seconds", "file_mb"):
            _positive(name, getattr(self, name))
        for name in ("memory_mb", "processes", "open_files", "tmpfs_mb"):
            _positive(name, getattr(self, name), integer=True)
        if self.open_files < 8:
            raise ValueError(f"`open_files` must be at least 8 (Python needs a few), got {self.open_files}.")

    def as_job(self) -> dict[str, Any]:
        return {
            "cpu_seconds": float(self.cpu_seconds),
            "wall_seconds": float(self.wall_seconds),
            "memory_bytes": int(self.memory_mb) << 20,
            "processes": int(self.processes),
            "open_files": int(self.open_files),
            "file_bytes": int(self.file_mb * (1 << 20)),
        }


@dataclass
class RunResult:
    """What one sandboxed run reported.

    Attributes:
        records: one dict per finished test, in order (``status`` is ``ok``, ``timeout``, ``memory``,
            ``runtime_error``, ``file_size_limit`` or ``not_run``; ``digest`` for a test that ran to its end).
        isolation: what the launcher set up: ``{"namespaces": bool, "uid": int}``, plus
            ``"backend": "bwrap"`` under bubblewrap.
        program_error: the program does not compile (its message), or None.
        fatal: the sandbox itself failed (set-up error), or None.
        stopped_early: the caller stopped the run (e.g. all-or-nothing scoring after a failed test).
        killed_at_deadline: the run was cut by its hard deadline or the caller's deadline.
        leaked: processes of the sandbox found alive after the run (and killed); 0 when isolation held.
        setup_failed: the isolation could not be set up (before any of the program's code ran).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    isolation: dict[str, Any] | None = None
    program_error: str | None = None
    fatal: str | None = None
    stopped_early: bool = False
    killed_at_deadline: bool = False
    leaked: int = 0
    setup_failed: bool = False


@functools.lru_cache(maxsize=8)
def _python_paths(python: str) -> list[str]:
    """Folders the interpreter needs (kept visible inside hidden paths)."""
    import site
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.add(os.path.dirname(os.path.realpath(python)))
    paths.update(site.getsitepackages())
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        value = sysconfig.get_paths().get(key)
        if value:
            paths.add(value)
    return sorted(os.path.realpath(p) for p in paths if p and os.path.isdir(p))


def default_hide_paths() -> list[str]:
    """What a program should not see: home folders, the Hugging Face cache, the cwd, and /run.

    ``/run`` holds the host's UNIX sockets (D-Bus, databases): the network namespace does not cover
    sockets on the file system.
    """
    paths = ["/root", "/home", os.path.expanduser("~"), "/run", "/var/run"]
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    paths.append(hf_home)
    cwd = os.getcwd()
    if cwd != "/":
        paths.append(cwd)
    return [p for p in dict.fromkeys(paths) if p]


def find_sandbox_processes(uids: Sequence[int] = (), session: int | None = None) -> list[int]:
    """Pids of live processes with one of ``uids`` (real uid) or in ``session`` (zombies excluded)."""
    wanted = set(uids)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 2 :].split()
            if fields[0] in (b"Z", b"X"):
                continue
            sid = int(fields[3])
            uid = None
            with open(f"/proc/{entry}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        uid = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue
        if (session is not None and sid == session) or (uid in wanted):
            found.append(int(entry))
    return found


# Sandboxes one process runs at the same time at most, each with a uid of its own (see Sandbox.uid).
SLOTS_PER_PROCESS = 256
# Linux's largest pid_max (2^22): the uid range uid_base + 256 x pid + slot must stay below 2^32 - 1.
_PID_LIMIT = 1 << 22
MAX_UID_BASE = (1 << 32) - 2 - SLOTS_PER_PROCESS * _PID_LIMIT


@dataclass(frozen=True)
class Sandbox:
    """Where and how programs run; :meth:`run` runs one program against its tests.

    Attributes:
        limits: the resource limits (:class:`SandboxLimits`).
        require_isolation: refuse to run (:class:`IsolationUnavailableError`) unless both the
            namespaces and the privilege drop are in place, i.e. without root (or with CAP_SYS_ADMIN
            and CAP_SETUID). ``False`` runs with what is available: see docs/guides/code.md for what a
            program can then do.
        namespaces: create the pid/network/mount/IPC/UTS namespaces (root only).
        drop_privileges: run programs as an unprivileged uid (root only): ``uid_base + 256 x pid + slot`` (a
            slot per concurrently running sandbox of this process), so that the process limit and
            kill-everything sweeps are per sandbox, whichever processes of the machine run sandboxes.
        uid_base: the first sandbox uid (and gid); choose a range no account on the machine uses.
        hide_paths: folders replaced by an empty read-only tmpfs inside the sandbox (the interpreter's
            own folders inside them stay visible); ``None``: :func:`default_hide_paths`.
        site_packages: programs may import installed packages (numpy, ...).
        python: the interpreter that runs the launcher and the programs.
        head_chars: characters of each test's output reported back (for logs).
        backend: who builds the namespaces and the file system: ``"namespaces"`` (the default: the
            launcher, on the host's file system minus ``hide_paths``), ``"bwrap"`` (bubblewrap, on an
            empty read-only root with only ``/usr``, the interpreter and a few ``/etc`` files; needs root and
            bubblewrap, checked here with a trial sandbox) or ``"auto"`` (``"bwrap"`` where that trial
            succeeds, else ``"namespaces"``). Limits, uids and verdicts are the same in all of them.
        bwrap: the bubblewrap executable, a path or a name looked up on PATH.
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    require_isolation: bool = True
    namespaces: bool = True
    drop_privileges: bool = True
    uid_base: int = 1_800_000_000
    hide_paths: tuple[str, ...] | None = None
    site_packages: bool = True
    python: str = sys.executable
    head_chars: int = 200
    backend: str = "namespaces"
    bwrap: str = "bwrap"

    def __post_init__(self) -> None:
        if not isinstance(self.limits, SandboxLimits):
            raise ValueError(f"`limits` must be a SandboxLimits, got {type(self.limits).__name__}.")
        if not isinstance(self.uid_base, int) or not 1000 <= self.uid_base <= MAX_UID_BASE:
            raise ValueError(
                f"`uid_base` must be an integer in [1000, {MAX_UID_BASE}] (the start of an unused range of "
                f"{SLOTS_PER_PROCESS} x pid_max uids), got {self.uid_base!r}."
            )
        if sys.platform != "linux":
            raise ValueError(
                f"the code sandbox needs Linux (rlimits, namespaces, /proc); this is {sys.platform}."
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                "`backend` must be 'namespaces' (the default), 'bwrap' (bubblewrap) or 'auto' (bwrap where it "
                f"runs, else namespaces), got {self.backend!r}."
            )
        if self.backend != "namespaces" and not (self.namespaces and self.drop_privileges):
            raise ValueError(
                f"backend={self.backend!r} always isolates with namespaces and the uid drop: namespaces=False "
                "and drop_privileges=False are settings of backend='namespaces' only."
            )
        if self.backend == "bwrap":
            why = self._bwrap_unusable()
            if why is not None:
                raise IsolationUnavailableError(
                    f"Sandbox(backend='bwrap') cannot run here: {why}. Install bubblewrap (apt-get install "
                    "bubblewrap) and run the trainer as root, pass its path as bwrap=..., or use "
                    "backend='namespaces' (or 'auto', which falls back to it)."
                )

    def _bwrap_unusable(self) -> str | None:
        return bwrap_unusable(self.bwrap, self.python, _LAUNCHER, tuple(_python_paths(self.python)))

    @property
    def resolved_backend(self) -> str:
        """``"namespaces"`` or ``"bwrap"``: what :meth:`run` uses (``"auto"`` decided by a trial, once)."""
        if self.backend == "auto":
            return "bwrap" if self._bwrap_unusable() is None else "namespaces"
        return self.backend

    def uid(self, slot: int) -> int:
        """The uid (and gid) of this process's sandbox ``slot``: a block of :data:`SLOTS_PER_PROCESS` uids per
        process id, so two processes of one machine (DDP ranks, two training jobs, two test workers) never
        share a uid: each one's sweep for leftover processes finds only its own, and RLIMIT_NPROC counts
        only its own."""
        return self.uid_base + SLOTS_PER_PROCESS * os.getpid() + slot

    def _job(
        self, program: str, mode: str, tests: list[dict[str, Any]], fn_name: str | None, slot: int
    ) -> dict[str, Any]:
        uid = self.uid(slot)
        return {
            "program": program,
            "mode": mode,
            "fn_name": fn_name,
            "tests": tests,
            "limits": self.limits.as_job(),
            "completion_seconds": float(self.limits.completion_seconds),
            "tmpfs_bytes": int(self.limits.tmpfs_mb) << 20,
            "namespaces": bool(self.namespaces),
            "drop_privileges": bool(self.drop_privileges),
            "require_isolation": bool(self.require_isolation),
            "uid": uid,
            "gid": uid,
            "hide_paths": list(default_hide_paths() if self.hide_paths is None else self.hide_paths),
            "keep_paths": _python_paths(self.python),
            "site": bool(self.site_packages),
            "env": dict(_CLEAN_ENV),
            "audit": False,
            "head_bytes": int(self.head_chars),
            "backend": self.resolved_backend,
        }

    def run(
        self,
        program: str,
        mode: str,
        tests: list[dict[str, Any]],
        *,
        fn_name: str | None = None,
        slot: int = 0,
        deadline: float | None = None,
        on_record: Callable[[dict[str, Any]], bool] | None = None,
    ) -> RunResult:
        """Run ``program`` against ``tests`` in a fresh sandbox.

        Args:
            program: Python source.
            mode: ``"stdio"`` (each test ``{"input": str}``: the program reads stdin, its stdout is
                digested), ``"call"`` (each test ``{"args": [...]}``: ``fn_name(*args)``'s return
                value, as JSON, is digested) or ``"assert"`` (each test ``{"code": str}``: Python run
                after the program in its namespace, passing when it finishes without raising).
            tests: the test inputs (never expected outputs).
            fn_name: the function to call (``"call"``).
            slot: which concurrently running sandbox this is (selects its uid).
            deadline: a ``time.monotonic()`` instant at which the run is killed.
            on_record: called with each test's record as it arrives; returning False stops the run.

        Returns:
            a :class:`RunResult`.

        Raises:
            IsolationUnavailableError: ``require_isolation`` is set and the isolation cannot be set up.
        """
        if mode not in ("stdio", "call", "assert"):
            raise ValueError(f"`mode` must be 'stdio', 'call' or 'assert', got {mode!r}.")
        if mode == "call" and not fn_name:
            raise ValueError("mode 'call' needs `fn_name`, the function to call.")
        job = self._job(program, mode, tests, fn_name, slot)
        result = RunResult()
        hard = time.monotonic() + self.limits.completion_seconds + 4.0
        if deadline is not None:
            hard = min(hard, deadline)
        import tempfile

        info: tuple[int, int] | None = None
        argv = [self.python, "-I", "-S", "-B", _LAUNCHER]
        if job["backend"] == "bwrap":
            info = os.pipe()  # bwrap writes the sandbox's pid 1 there, for the leftover sweep
            # The path found on the trainer's PATH, as the trial ran it (the launch's PATH is the clean one).
            bwrap = find_bwrap(self.bwrap) or self.bwrap
            argv = bwrap_argv(bwrap, self.python, _LAUNCHER, job, info_fd=info[1])
        try:
            with tempfile.TemporaryFile() as job_file:
                job_file.write(json.dumps(job).encode())
                job_file.seek(0)
                proc = subprocess.Popen(
                    argv,
                    stdin=job_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=dict(_CLEAN_ENV),
                    cwd="/",
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(info[1],) if info else (),
                )
        except BaseException:
            if info:
                os.close(info[0])
            raise
        finally:
            if info:
                os.close(info[1])
        try:
            self._read_records(proc, result, hard, on_record)
        finally:
            try:
                self._finish(proc, result, job, None if info is None else info[0])
            finally:
                if info:
                    os.close(info[0])
        if result.setup_failed:
            # Nothing of the program ran: the machine cannot isolate it, and every completion would
            # score 0. Said loudly, once, instead of training on zero reward.
            reason = result.fatal or "the sandbox could not be set up"
            if job["backend"] == "bwrap":
                raise IsolationUnavailableError(
                    f"the bwrap code sandbox could not be set up: {reason}. Use backend='namespaces'."
                )
            raise IsolationUnavailableError(_isolation_help(reason))
        return result

    def _read_records(
        self,
        proc: subprocess.Popen[bytes],
        result: RunResult,
        hard: float,
        on_record: Callable[[dict[str, Any]], bool] | None,
    ) -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buffer = b""
        while True:
            left = hard - time.monotonic()
            if left <= 0:
                result.killed_at_deadline = True
                return
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            buffer += chunk
            if len(buffer) > 1 << 24:  # the harness's records are small; this is not one
                result.fatal = "the sandbox wrote more than 16 MiB of records"
                return
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    result.fatal = f"the sandbox wrote a line that is not a record: {line[:100]!r}"
                    return
                if "isolation" in record:
                    result.isolation = record["isolation"]
                elif "fatal" in record:
                    result.fatal = str(record["fatal"])
                    result.setup_failed = bool(record.get("setup"))
                elif "fatal_program" in record:
                    result.program_error = str(record["fatal_program"])
                elif "test" in record:
                    result.records.append(record)
                    if on_record is not None and not on_record(record):
                        result.stopped_early = True
                        return

    def _finish(
        self, proc: subprocess.Popen[bytes], result: RunResult, job: dict[str, Any], info_fd: int | None
    ) -> None:
        # The launcher's process group holds the launcher and the namespace's pid 1: killing pid 1 kills
        # everything in the namespace. Without namespaces, the uid sweep and the session sweep below
        # catch what escaped the group. Under bwrap, pid 1 has a session of its own (--new-session) and dies
        # with bwrap (--die-with-parent); it is watched through a pidfd taken while bwrap still holds it (a
        # pid is not reused before its parent reaps it), and killed (a leak) if it outlives bwrap.
        pid_one = None
        if info_fd is not None and proc.poll() is None:
            child = read_child_pid(info_fd)
            with contextlib.suppress(OSError, TypeError):
                pid_one = os.pidfd_open(child)  # type: ignore[arg-type]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        harness_leaked = 0
        if pid_one is not None:
            try:
                if not select.select([pid_one], [], [], 1.0)[0]:
                    harness_leaked = 1
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pid_one, signal.SIGKILL)
                    select.select([pid_one], [], [], 1.0)
            finally:
                os.close(pid_one)
        if info_fd is not None and result.isolation is None and not result.killed_at_deadline:
            # bwrap or the launcher failed before the launcher's first record, before any of the program's
            # code: as with a failed mount of the namespaces backend, the trainer raises it.
            result.setup_failed = True
        if proc.stderr is not None:
            err = proc.stderr.read(4096).decode("utf-8", "replace").strip()
            if err and result.fatal is None and not result.records and result.program_error is None:
                result.fatal = f"the sandbox launcher failed: {err.splitlines()[-1][:500]}"
            proc.stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()
        uids = [job["uid"]] if (result.isolation or {}).get("uid") == job["uid"] else []
        if (result.isolation or {}).get("namespaces"):
            # Killing the namespace's pid 1 makes the kernel kill the rest, which takes a moment: only
            # what is still alive after that is a leak.
            grace = time.monotonic() + 1.0
            while find_sandbox_processes(uids, session=proc.pid) and time.monotonic() < grace:
                time.sleep(0.005)
        leaked: set[int] = set()
        for _ in range(10):
            left = find_sandbox_processes(uids, session=proc.pid)
            if not left:
                break
            leaked.update(left)
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        result.leaked = len(leaked) + harness_leaked
        if result.leaked:
            logger.warning("code sandbox: killed %d process(es) left behind by a program", result.leaked)


def _isolation_help(reason: str) -> str:
    return (
        f"the code sandbox cannot isolate programs here: {reason}. It needs root (or CAP_SYS_ADMIN and "
        "CAP_SETUID) for its namespaces and unprivileged uids. Run the trainer as root (e.g. in its "
        "container), or accept a weaker sandbox with require_isolation=False (then a program can reach the "
        "network and signal your processes through ctypes; see docs/guides/code.md)."
    )


# Concurrency: one slot (and uid) per sandbox running at the same time in this process.
class SlotPool:
    """Hands out slot numbers 0..n-1 to threads running sandboxes at the same time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            if self._next > SLOTS_PER_PROCESS:
                raise RuntimeError(f"more than {SLOTS_PER_PROCESS} sandboxes at once in one process")
            return self._next - 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


SLOTS = SlotPool()
