"""math-verify under a per-item timeout: an in-process SIGALRM timer, or a pool of worker processes.

This module imports only the standard library at import time (math-verify is imported where it is used)
because :func:`trl_sae.rewards.math.math_accuracy`'s worker process loads this file on its own, by path
and without the package (see ``_WORKER_BOOTSTRAP``), so that it starts in about a second. Keep it so:
no ``trl_sae`` import, no third-party import at module level.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DIED",
    "TIMEOUT",
    "cached_scorer",
    "default_num_workers",
    "first_pass_seconds",
    "process_pool",
    "score_with_alarm",
    "signal_backend_available",
]

logger = logging.getLogger(__name__)

_MATH_VERIFY_HINT = 'math_accuracy needs math-verify, an optional extra: pip install "trl-sae[math]"'


# --------------------------------------------------------------------------------------------------
# Math accuracy: math-verify under a per-item timeout.
#
# math-verify's own timeout is signal.alarm(), which raises in threads that are not the main thread, has
# whole-second resolution and cancels any other SIGALRM timer (pytest-timeout's, for one). So we pass it
# no timeout and bound each item ourselves:
#   * "signal" (the main thread on POSIX): a SIGALRM interval timer around each item, raising an exception
#     derived from BaseException so that the `except Exception` blocks of math-verify and sympy cannot
#     swallow it; an outer SIGALRM timer is paused and re-armed with its remaining time afterwards.
#   * "process" (any thread): items go to a pool of long-lived worker processes over pipes, one item per
#     worker at a time, so a batch is verified in parallel. A worker stops an overrunning item with its
#     own SIGALRM timer and carries on; one stuck where that cannot reach it (inside C code) is killed
#     and replaced.
# "auto" picks "process" when the pool would have more than one worker, else "signal" where it can.
# --------------------------------------------------------------------------------------------------
TIMEOUT = object()  # sentinel result: the item ran out of time


class _ItemTimeout(BaseException):
    """Raised by the SIGALRM handler when an item overruns its budget."""


def _raise_item_timeout(signum: int, frame: Any) -> None:
    raise _ItemTimeout


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns "Timeout is disabled ..." when called without its own timeout; ours is on.
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(_MATH_VERIFY_HINT) from error
    log_filter = _DropTimeoutDisabledWarning()
    for logger_name in ("math_verify.parser", "math_verify.grader"):
        mv_logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _DropTimeoutDisabledWarning) for f in mv_logger.filters):
            mv_logger.addFilter(log_filter)
    return math_verify


class _MathScorer:
    """Parse the gold answer and a completion's final answer with math-verify and compare them.

    No timeout of its own: the caller bounds each :meth:`score` call.
    """

    _GOLD_CACHE_SIZE = 4096

    def __init__(self, float_rounding: int = 6, numeric_precision: int = 15, strict: bool = True) -> None:
        mv = _import_math_verify()
        self._parse = mv.parse
        self._verify = mv.verify
        self._verify_kwargs = {
            "float_rounding": float_rounding,
            "numeric_precision": numeric_precision,
            "strict": strict,
        }
        # Gold answers are bare (e.g. "34", "\frac{1}{2}", "x^2+1"): try LaTeX, then a plain expression.
        self._gold_config = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
        # Completions: the final answer only. A \boxed{} comes first; anchors such as "the final answer
        # is" also count, but a number merely mentioned in the reasoning does not.
        self._completion_config = [
            mv.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
            mv.ExprExtractionConfig(try_extract_without_anchor=False),
        ]
        self._gold_cache: dict[str, list[Any]] = {}

    def parse_gold(self, gold: str) -> list[Any]:
        cached = self._gold_cache.get(gold)
        if cached is None:
            text = gold.strip()
            # Inside $...$ the LaTeX extractor reads the whole answer ("2\pi", "10^{10}") instead of its
            # first number, as it would in running text.
            if text and "$" not in text and "\\boxed" not in text:
                text = f"${text}$"
            cached = self._parse(text, self._gold_config, extraction_mode="first_match", parsing_timeout=None)
            if len(self._gold_cache) >= self._GOLD_CACHE_SIZE:
                self._gold_cache.clear()
            self._gold_cache[gold] = cached
        return cached

    # One answer of each kind whose first parse imports more of sympy: a symbolic expression and a tuple
    # each cost ~0.5 s the first time, ~1 ms after; a batch's short first pass must not pay that.
    _WARM_UP_ITEMS = (
        ("x^2+1", r"\boxed{1+x^2}"),
        ("(1,2)", r"\boxed{(1, 2)}"),
        (r"\sqrt{12}", r"\boxed{2\sqrt{3}}"),
        ("0.5", r"\boxed{0.4}"),
        ("34", r"The final answer is $\frac{3}{4}$."),
    )

    def warm_up(self) -> None:
        """Parse a few answers once, so math-verify's and sympy's lazy imports (~1.5 s) do not count
        against a real item's timeout. Parsing only: it never runs a verification."""
        self.parse_gold("1")
        for gold, completion in (("1", r"\boxed{\frac{1}{2}}"), *self._WARM_UP_ITEMS):
            self.parse_gold(gold)
            self._parse(
                completion, self._completion_config, extraction_mode="first_match", parsing_timeout=None
            )
        self._gold_cache.clear()

    def score(self, gold: str, completion: str) -> float | None:
        """1.0 / 0.0, or ``None`` when the gold answer cannot be parsed."""
        gold_parsed = self.parse_gold(gold)
        if not gold_parsed:
            return None
        predicted = self._parse(
            completion, self._completion_config, extraction_mode="first_match", parsing_timeout=None
        )
        if not predicted:
            return 0.0
        return (
            1.0 if self._verify(gold_parsed, predicted, timeout_seconds=None, **self._verify_kwargs) else 0.0
        )


@functools.lru_cache(maxsize=8)
def cached_scorer(config: tuple[tuple[str, Any], ...]) -> _MathScorer:
    scorer = _MathScorer(**dict(config))
    scorer.warm_up()  # outside any item's timer
    return scorer


def signal_backend_available() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        # None: a handler installed from C, which Python could not restore afterwards.
        and signal.getsignal(signal.SIGALRM) is not None
    )


def first_pass_seconds(timeout_seconds: float) -> float:
    """Budget of every item's first try in a batch: a tenth of the cap, at least 0.25 s, at most the cap.

    Ordinary answers verify in milliseconds; an item over this budget is retried in the batch's second
    pass, with the whole cap but under one deadline shared by all retried items (see ``math.py``).
    """
    return min(timeout_seconds, max(0.25, 0.1 * timeout_seconds))


def _item_budget(timeout_seconds: float | None, deadline: float | None) -> float | None:
    """An item's timeout: the cap, cut to what is left until the batch's ``deadline`` (monotonic)."""
    if deadline is None:
        return timeout_seconds
    left = deadline - time.monotonic()
    return left if timeout_seconds is None else min(timeout_seconds, left)


def score_with_alarm(
    scorer: _MathScorer,
    items: list[tuple[str, str]],
    timeout_seconds: float,
    deadline: float | None = None,
) -> list[float | object | None]:
    """Score items in this (main) thread, each under a SIGALRM interval timer.

    With ``deadline`` (a ``time.monotonic()`` instant) an item gets at most the time left until it, and
    an item reached after it is not run: it times out.
    """
    previous_handler = signal.signal(signal.SIGALRM, _raise_item_timeout)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, 0)  # pause an outer timer
    started = time.monotonic()
    results: list[float | object | None] = []
    try:
        for gold, completion in items:
            budget = _item_budget(timeout_seconds, deadline)
            assert budget is not None
            if budget <= 0:
                results.append(TIMEOUT)
                continue
            try:
                signal.setitimer(signal.ITIMER_REAL, budget)
                try:
                    result: float | object | None = scorer.score(gold, completion)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except _ItemTimeout:
                result = TIMEOUT
            results.append(result)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:
            # Re-arm the outer timer with what it had left (at least a moment, so an expired one fires).
            remaining = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), previous_interval)
    return results


# The worker runs this file as a standalone module (not through the package, whose __init__ imports
# torch and TRL) and serves JSON lines: {"gold", "completion"} -> {"score"} or {"error"}.
_WORKER_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_trl_sae_math_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(sys.argv[2])\n"
)


def _worker_command(config_json: str) -> list[str]:
    """The worker's command line (a function so tests can substitute a misbehaving worker)."""
    return [sys.executable, "-c", _WORKER_BOOTSTRAP, os.path.abspath(__file__), config_json]


def _worker_main(config_json: str) -> None:
    """Entry point of the worker process: score requests from stdin until it closes."""
    protocol = sys.stdout
    sys.stdout = sys.stderr  # a stray print() must not corrupt the protocol stream
    try:
        scorer = _MathScorer(**json.loads(config_json))
        scorer.warm_up()
    except Exception as error:
        protocol.write(json.dumps({"ready": False, "error": f"{type(error).__name__}: {error}"}) + "\n")
        protocol.flush()
        return
    # Each item runs under two timers (POSIX):
    #  * soft, wall clock: SIGALRM raises _ItemTimeout at the item's timeout, as in the "signal" backend;
    #    the worker replies {"timeout": true} and lives on, so a pathological answer costs its timeout
    #    and no restart (~1 s of imports);
    #  * backstop, CPU time: code that never returns to Python (a hang inside C) cannot see the soft
    #    timer, so the parent kills the worker shortly after the timeout; and if the parent is gone
    #    (SIGKILLed: no atexit, and stdin is only read between items), SIGPROF's default action ends
    #    the worker after `_WORKER_SELF_KILL_FACTOR x timeout + 1` seconds of CPU.
    timers = hasattr(signal, "setitimer")
    if timers:
        signal.signal(signal.SIGALRM, _raise_item_timeout)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
    protocol.write(json.dumps({"ready": True}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        timeout = request.get("timeout")
        armed = bool(timers and timeout)
        try:
            try:
                if armed:
                    signal.setitimer(signal.ITIMER_PROF, _WORKER_SELF_KILL_FACTOR * timeout + 1.0)
                    signal.setitimer(signal.ITIMER_REAL, timeout)
                response: dict[str, Any] = {"score": scorer.score(request["gold"], request["completion"])}
            finally:
                if armed:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.setitimer(signal.ITIMER_PROF, 0)
        except _ItemTimeout:
            response = {"timeout": True}
        except Exception as error:
            response = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(response) + "\n")
        protocol.flush()


_WORKER_SELF_KILL_FACTOR = 2.0


def _kill_grace(timeout_seconds: float) -> float:
    """How long after an item's timeout the parent waits for the worker's own timer before killing it."""
    return min(1.0, 0.2 * timeout_seconds) + 0.1


class _WorkerDied(RuntimeError):
    pass


class _ProcessVerifier:
    """A long-lived worker process scoring one item at a time; killed and restarted on a timeout."""

    def __init__(self, config_json: str, startup_timeout: float = 120.0) -> None:
        self._config_json = config_json
        self._startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._responses: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._owner_pid = os.getpid()
        self._closed = False

    @staticmethod
    def _pump(stream: Any, responses: queue.SimpleQueue[dict[str, Any] | None]) -> None:
        # A reader thread turns the worker's stdout into a queue, so waiting for a reply can time out on
        # every platform (select() does not work on pipes on Windows).
        try:
            for line in stream:
                try:
                    responses.put(json.loads(line))
                except ValueError:
                    logger.debug("math_accuracy worker wrote a non-protocol line: %r", line)
        except (OSError, ValueError):
            pass  # the pipe was closed under us: the worker is being killed
        responses.put(None)  # EOF: the worker exited

    def _start(self) -> None:
        proc = subprocess.Popen(
            _worker_command(self._config_json),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            bufsize=1,
        )
        responses: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(
            target=self._pump, args=(proc.stdout, responses), name="trl-sae-math-verify-reader", daemon=True
        ).start()
        self._proc, self._responses = proc, responses
        try:
            ready = responses.get(timeout=self._startup_timeout)
        except queue.Empty:
            ready = {"ready": False, "error": f"no answer within {self._startup_timeout}s"}
        if not ready or not ready.get("ready"):
            self._kill()
            error = (ready or {}).get("error", "it exited during start-up")
            if error.startswith("ImportError"):
                raise ImportError(_MATH_VERIFY_HINT)
            raise RuntimeError(f"math_accuracy's verification worker failed to start: {error}")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def _ensure_started_locked(self) -> None:
        if os.getpid() != self._owner_pid:
            # A forked copy of this object: the pipes belong to the parent, so start our own worker.
            self._proc, self._owner_pid = None, os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()

    @property
    def running(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None and os.getpid() == self._owner_pid

    def ensure_started(self) -> None:
        """Start the worker if it is not running (used to replace a killed one ahead of the next batch)."""
        with self._lock:
            if not self._closed:
                self._ensure_started_locked()

    def score(self, gold: str, completion: str, timeout_seconds: float | None) -> float | object | None:
        with self._lock:
            self._ensure_started_locked()
            assert self._proc is not None and self._proc.stdin is not None
            request = {"gold": gold, "completion": completion, "timeout": timeout_seconds}
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                # The worker stops the item itself at `timeout_seconds` (and says so); a worker that has
                # not answered a little later is stuck where its timer cannot reach: kill it.
                wait = None if timeout_seconds is None else timeout_seconds + _kill_grace(timeout_seconds)
                response = self._responses.get(timeout=wait)
            except queue.Empty:
                self._kill()
                return TIMEOUT
            except OSError as error:  # broken pipe: the worker died between items
                self._kill()
                raise _WorkerDied(str(error)) from error
            if response is None:
                try:
                    code = self._proc.wait(timeout=5.0) if self._proc is not None else None
                except subprocess.TimeoutExpired:
                    code = None
                self._kill()
                if hasattr(signal, "SIGPROF") and code == -signal.SIGPROF:
                    return TIMEOUT  # its own backstop timer fired before we killed it (a loaded machine)
                raise _WorkerDied(f"the worker exited (code {code}), e.g. out of memory")
            if response.get("timeout"):
                return TIMEOUT
            if "error" in response:
                logger.debug("math_accuracy worker error: %s", response["error"])
                return 0.0
            return response["score"]

    def close(self) -> None:
        # The worker holds no state worth a graceful exit (sympy's shutdown alone takes ~0.5 s).
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # at once, even while another thread holds the lock waiting for its start-up
        with self._lock:
            self._kill()


DIED = object()  # sentinel result: the worker died on the item (e.g. out of memory)

# Workers in a default pool: one per CPU this process may use, shared among the processes of one
# machine (torchrun/accelerate set LOCAL_WORLD_SIZE), at most this many: each worker holds ~60-100 MB,
# and a batch of a few hundred answers gains little from more.
_MAX_DEFAULT_WORKERS = 16


def default_num_workers() -> int:
    """Verification workers for this process: its usable CPUs / processes on this machine, in [1, 16]."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_processes = 1
    return max(1, min(cpus // local_processes, _MAX_DEFAULT_WORKERS))


class _VerifierPool:
    """Up to N :class:`_ProcessVerifier` workers sharing a batch, each taking the next unscored item.

    A batch of ``B`` items on ``n`` workers takes about ``(normal work) / n + ceil(P / n) x timeout`` for
    ``P`` items that overrun the timeout: a worker interrupts such an item itself and takes the next one.
    Only a worker stuck where its timer cannot reach (inside C code) is killed, ``_kill_grace`` after
    the timeout, and replaced (~1 s: a new interpreter importing sympy and math-verify) before it takes
    another item, or in the background once the batch is done, so the next batch does not wait for it.
    """

    def __init__(self, config_json: str) -> None:
        self._config_json = config_json
        self._lock = threading.Lock()
        self._verifiers: list[_ProcessVerifier] = []

    def _take(self, n: int) -> list[_ProcessVerifier]:
        with self._lock:
            while len(self._verifiers) < n:
                self._verifiers.append(_ProcessVerifier(self._config_json))
            return self._verifiers[:n]

    def score_many(
        self,
        items: Sequence[tuple[str, str]],
        timeout_seconds: float | None,
        num_workers: int,
        deadline: float | None = None,
    ) -> tuple[list[float | object | None], list[str]]:
        """Score ``items`` on up to ``num_workers`` workers; returns results (or sentinels) and death notes.

        With ``deadline`` (a ``time.monotonic()`` instant) the batch ends by then (plus the kill grace):
        an item gets at most the time left, one taken after it times out at once, and one whose worker
        has not answered by then times out; that worker is killed shortly after and replaced.
        """
        results: list[float | object | None] = [None] * len(items)
        if not items:
            return results, []
        verifiers = self._take(max(1, min(num_workers, len(items))))
        recorded = [False] * len(items)
        state = {"next": 0, "done": 0, "drivers": len(verifiers), "closed": False}
        state_lock = threading.Lock()
        finished = threading.Event()
        errors: list[BaseException] = []
        deaths: list[str] = []

        def take() -> int | None:
            with state_lock:
                if state["closed"] or errors or state["next"] >= len(items):
                    return None
                state["next"] += 1
                return state["next"] - 1

        def record(index: int, result: float | object | None, death: str | None = None) -> None:
            with state_lock:
                if state["closed"]:  # the caller has returned at the deadline: too late to count
                    return
                results[index], recorded[index] = result, True
                if death is not None:
                    deaths.append(death)
                state["done"] += 1
                if state["done"] == len(items):
                    finished.set()

        def drive(verifier: _ProcessVerifier) -> None:
            try:
                while True:
                    if not verifier.running:
                        # Start (or replace a killed) worker *before* taking an item, so the items left
                        # go to the workers that are up in the meantime.
                        verifier.ensure_started()
                    index = take()
                    if index is None:
                        break
                    gold, completion = items[index]
                    budget = _item_budget(timeout_seconds, deadline)
                    if budget is not None and budget <= 0:
                        record(index, TIMEOUT)  # the batch's time is up: not started
                        continue
                    try:
                        record(index, verifier.score(gold, completion, budget))
                    except _WorkerDied as error:
                        record(index, DIED, death=str(error))
            except BaseException as error:  # a start-up failure: handed to the caller
                with state_lock:
                    errors.append(error)
                finished.set()
                return
            finally:
                with state_lock:
                    state["drivers"] -= 1
                    if state["drivers"] == 0:  # nobody left to score: do not wait for the deadline
                        finished.set()
            # Replace a worker killed on this batch now, not at the start of the next one. The caller
            # does not wait for this: it returns as soon as every item has a result.
            if not verifier.running:
                try:
                    verifier.ensure_started()
                except Exception as error:  # reported when the next batch tries again
                    logger.debug("math_accuracy worker restart failed: %s", error)

        for verifier in verifiers:
            threading.Thread(target=drive, args=(verifier,), name="trl-sae-math-verify", daemon=True).start()
        if deadline is None or timeout_seconds is None:
            finished.wait()
        else:
            # A worker answers by the deadline (its own timer), or is killed `_kill_grace` after it.
            finished.wait(max(0.0, deadline - time.monotonic()) + _kill_grace(timeout_seconds) + 0.1)
        with state_lock:
            state["closed"] = True  # drivers still busy past this point no longer write results
            if errors:
                raise errors[0]
            return [r if done else TIMEOUT for r, done in zip(results, recorded)], list(deaths)

    def close(self) -> None:
        with self._lock:
            verifiers, self._verifiers = self._verifiers, []
        for verifier in verifiers:
            verifier.close()


_PROCESS_POOLS: dict[str, _VerifierPool] = {}
_PROCESS_POOLS_LOCK = threading.Lock()


def process_pool(config_json: str) -> _VerifierPool:
    with _PROCESS_POOLS_LOCK:
        pool = _PROCESS_POOLS.get(config_json)
        if pool is None:
            pool = _PROCESS_POOLS[config_json] = _VerifierPool(config_json)
        return pool


@atexit.register
def _close_process_verifiers() -> None:
    """Kill every verification worker (at exit; tests call it to start afresh)."""
    with _PROCESS_POOLS_LOCK:
        pools = list(_PROCESS_POOLS.values())
        _PROCESS_POOLS.clear()
    for pool in pools:
        pool.close()
