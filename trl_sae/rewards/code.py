"""Code reward: run the program in a completion's last fenced code block against the row's tests, sandboxed.

:func:`code_tests` (``reward_funcs: [code_tests]``) reads the tests from the dataset column ``tests`` (the
format :func:`parse_code_tests` accepts; :mod:`trl_sae.code_data` loads APPS, TACO, CodeContests,
DeepCoder, HumanEval and MBPP layouts into it) and runs every program in a fresh sandbox
(:mod:`trl_sae.rewards.sandbox`), several at a time. :func:`make_code_reward` sets the scoring (all or
nothing, as the paper's DeepCoder recipe, or the fraction of tests passed), the limits and the batch
deadline.

Output comparison (stdin/stdout tests), as the APPS and TACO graders do it, whitespace-tolerant: both the
program's output and the expected output are split into lines, each line's words are joined by single
spaces (so trailing spaces, tabs and ``\\r`` do not matter), blank lines at the start and the end are
dropped, and the lines must then be equal; blank lines in the middle count, and numbers are compared as
text (no float tolerance). Function-call tests compare the returned value with the expected one as JSON
data (tuples as lists, ``1.0`` equal to ``1``), also accepting ``[result] == expected`` (APPS stores
call outputs wrapped in a list).
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from trl_sae.code_data import CodeTests, parse_code_tests
from trl_sae.rewards._verify_worker import default_num_workers
from trl_sae.rewards.base import RewardFunction, completion_text, required_column
from trl_sae.rewards.sandbox import SLOTS, SLOTS_PER_PROCESS, Sandbox, SandboxLimits

__all__ = [
    "CodeTests",
    "CodeVerdict",
    "code_tests",
    "extract_code",
    "make_code_reward",
    "parse_code_tests",
]

logger = logging.getLogger(__name__)

Scoring = Literal["all_or_nothing", "fraction"]

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


def extract_code(text: str) -> tuple[str | None, str | None]:
    """The last complete fenced Python code block of ``text``: ``(code, None)`` or ``(None, reason)``.

    A block tagged ``python``/``py``/``python3`` or untagged counts; one tagged with another language
    (```` ```cpp ````) does not. A block whose closing fence is missing (a truncated completion) does not.

    Example:
        >>> extract_code("First try:\\n```python\\nprint(1)\\n```\\nBetter:\\n```python\\nprint(2)\\n```")
        ('print(2)\\n', None)
        >>> extract_code("no code here")
        (None, 'no code block')
    """
    blocks = _FENCE_RE.findall(text)
    if not blocks:
        return None, "no code block"
    python = [code for tag, code in blocks if tag.lower() in _PYTHON_TAGS]
    if not python:
        return None, f"no Python code block (last one is {blocks[-1][0]!r})"
    code = python[-1]
    if not code.strip():
        return None, "empty code block"
    return code, None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


@dataclass
class CodeVerdict:
    """How one completion scored: ``passed`` of ``total`` tests; ``reason`` says why it was not all."""

    score: float
    passed: int = 0
    total: int = 0
    reason: str = ""
    statuses: list[str] = field(default_factory=list)


@dataclass
class _Item:
    index: int
    program: str
    tests: CodeTests
    expected: list[str] = field(default_factory=list)
    results: dict[int, bool] = field(default_factory=dict)
    statuses: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    cut: bool = False


class _CodeReward:
    """The callable behind :func:`code_tests` and :func:`make_code_reward`."""

    def __init__(
        self,
        *,
        sandbox: Sandbox,
        scoring: Scoring,
        tests_column: str,
        num_workers: int | None,
        batch_seconds: float | None,
        name: str,
    ) -> None:
        if not isinstance(sandbox, Sandbox):
            raise ValueError(
                f"`sandbox` must be a trl_sae.rewards.sandbox.Sandbox, got {type(sandbox).__name__}."
            )
        if scoring not in ("all_or_nothing", "fraction"):
            raise ValueError(f"`scoring` must be 'all_or_nothing' or 'fraction', got {scoring!r}.")
        if num_workers is not None and not (
            isinstance(num_workers, numbers.Integral)
            and not isinstance(num_workers, bool)
            and 1 <= num_workers <= SLOTS_PER_PROCESS
        ):
            raise ValueError(
                f"`num_workers` must be an integer in [1, {SLOTS_PER_PROCESS}] (sandboxes at once in one "
                f"process) or None, got {num_workers!r}."
            )
        if batch_seconds is not None and not (
            isinstance(batch_seconds, numbers.Real)
            and not isinstance(batch_seconds, bool)
            and batch_seconds > 0
        ):
            raise ValueError(f"`batch_seconds` must be a positive number or None, got {batch_seconds!r}.")
        self.sandbox = sandbox
        self.scoring = scoring
        self.tests_column = tests_column
        self.num_workers = None if num_workers is None else int(num_workers)
        self.batch_seconds = None if batch_seconds is None else float(batch_seconds)
        self.__name__ = name
        #: One :class:`CodeVerdict` per completion of the last batch (scores, counts and reasons).
        self.last_verdicts: list[CodeVerdict] = []
        #: Counts for the last batch: ``cut_by_deadline`` (completions the batch deadline stopped or never
        #: started), ``leaked`` (processes the parent had to kill after a run: 0 when isolation holds).
        self.last_stats: dict[str, int] = {}
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return (
            f"make_code_reward(scoring={self.scoring!r}, tests_column={self.tests_column!r}, "
            f"num_workers={self.num_workers}, batch_seconds={self.batch_seconds}, name={self.__name__!r})"
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{self.__name__}: {message}", RuntimeWarning, stacklevel=4)

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        name = self.__name__
        cells = required_column(
            columns,
            self.tests_column,
            reward=name,
            holds="the tests",
            fix="Load the data with trl_sae.code_data.load_code_dataset or use "
            "make_code_reward(tests_column=...).",
            num_completions=len(completions),
        )
        from trl_sae.rewards._sandbox_launcher import canonical_json, normalize_output

        verdicts: list[CodeVerdict | None] = [None] * len(completions)
        items: list[_Item] = []
        for i, (completion, cell) in enumerate(zip(completions, cells)):
            try:
                tests = parse_code_tests(cell)
            except ValueError as error:
                verdicts[i] = CodeVerdict(0.0, reason=f"bad tests: {error}")
                self._warn_once(
                    "bad-tests", f"a row's tests are unusable ({error}); it scores 0 (shown once)."
                )
                continue
            program, why = extract_code(completion_text(completion))
            if program is None:
                verdicts[i] = CodeVerdict(0.0, total=len(tests), reason=why or "no code")
                continue
            item = _Item(i, tests.program(program), tests)
            if tests.kind == "stdio":
                item.expected = [_digest(normalize_output(o)) for o in tests.outputs]
            elif tests.kind == "call":
                item.expected = [_digest(canonical_json(o)) for o in tests.outputs]
            items.append(item)
        deadline = None if self.batch_seconds is None else time.monotonic() + self.batch_seconds
        stats = {"cut_by_deadline": 0, "leaked": 0}
        self._run_all(items, deadline, stats)
        for item in items:
            verdicts[item.index] = self._verdict(item)
            if item.cut:
                stats["cut_by_deadline"] += 1
        self.last_verdicts = [v for v in verdicts if v is not None]
        self.last_stats = stats
        for i, verdict in enumerate(self.last_verdicts):
            logger.debug(
                "%s[%d]: %.3f (%d/%d) %s",
                name,
                i,
                verdict.score,
                verdict.passed,
                verdict.total,
                verdict.reason,
            )
        if stats["cut_by_deadline"]:
            self._warn_once(
                "deadline",
                f"the batch deadline ({self.batch_seconds}s) cut {stats['cut_by_deadline']} completion(s); they "
                "scored on the tests finished by then (shown once). Raise make_code_reward(batch_seconds=...) "
                "or lower the per-test limits.",
            )
        return [v.score for v in self.last_verdicts]

    def _verdict(self, item: _Item) -> CodeVerdict:
        total = len(item.tests)
        passed = sum(item.results.values())
        statuses = [item.statuses.get(k, "not_run") for k in range(total)]
        if self.scoring == "all_or_nothing":
            score = 1.0 if passed == total else 0.0
        else:
            score = passed / total
        if item.error is not None:
            reason = item.error
        elif passed == total:
            reason = "passed"
        elif item.cut and len(item.statuses) < total:
            reason = "batch deadline"
        else:
            first = next(k for k in range(total) if not item.results.get(k, False))
            reason = f"test {first}: {statuses[first]}"
        return CodeVerdict(score, passed, total, reason, statuses)

    def _record(self, item: _Item, record: dict[str, Any]) -> bool:
        k = int(record["test"])
        status = record.get("status", "runtime_error")
        ok = False
        if status == "ok":
            if item.tests.kind == "assert":
                ok = True
            else:
                expected = item.expected[k]
                ok = record.get("digest") == expected or (
                    item.tests.kind == "call" and record.get("digest_wrapped") == expected
                )
                if not ok:
                    status = "wrong_answer"
        item.results[k], item.statuses[k] = ok, status
        # All or nothing: one failed test decides; the remaining ones are not worth running.
        return ok or self.scoring != "all_or_nothing"

    def _run_one(
        self, item: _Item, deadline: float | None, stats: dict[str, int], lock: threading.Lock
    ) -> None:
        tests = item.tests
        if tests.kind == "stdio":
            payload = [{"input": x} for x in tests.inputs]
        elif tests.kind == "call":
            payload = [{"args": list(a)} for a in tests.inputs]
        else:
            payload = [{"code": a} for a in tests.asserts]
        slot = SLOTS.acquire()
        try:
            result = self.sandbox.run(
                item.program,
                tests.kind,
                payload,
                fn_name=tests.fn_name,
                slot=slot,
                deadline=deadline,
                on_record=lambda record: self._record(item, record),
            )
        finally:
            SLOTS.release(slot)
        with lock:
            stats["leaked"] += result.leaked
        if result.program_error is not None:
            item.error = f"syntax error: {result.program_error}"
        elif result.fatal is not None:
            item.error = f"sandbox error: {result.fatal}"
            self._warn_once(
                "fatal", f"a sandbox failed ({result.fatal}); that completion scored 0 (shown once)."
            )
        if result.killed_at_deadline and deadline is not None and time.monotonic() >= deadline - 0.05:
            item.cut = True

    def _run_all(self, items: list[_Item], deadline: float | None, stats: dict[str, int]) -> None:
        if not items:
            return
        workers = min(len(items), self.num_workers or default_num_workers())
        queue = list(reversed(items))
        lock = threading.Lock()
        errors: list[BaseException] = []

        def drive() -> None:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    item = queue.pop()
                if deadline is not None and time.monotonic() >= deadline:
                    item.cut = True
                    continue
                try:
                    self._run_one(item, deadline, stats, lock)
                except BaseException as error:  # isolation unavailable, or a bug: the caller raises it
                    with lock:
                        errors.append(error)
                    return

        threads = [
            threading.Thread(target=drive, name="trl-sae-code-reward", daemon=True) for _ in range(workers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]


def make_code_reward(
    *,
    scoring: Scoring = "all_or_nothing",
    tests_column: str = "tests",
    cpu_seconds: float = 2.0,
    wall_seconds: float = 4.0,
    completion_seconds: float = 30.0,
    batch_seconds: float | None = 120.0,
    memory_mb: int = 1024,
    num_workers: int | None = None,
    sandbox: Sandbox | None = None,
    name: str = "code_tests",
    backend: str = "namespaces",
) -> RewardFunction:
    """A :func:`code_tests` with its own settings.

    Args:
        scoring: ``"all_or_nothing"`` (1.0 when every test passes, else 0.0; the paper's DeepCoder
            recipe; stops a program's run at its first failed test) or ``"fraction"`` (the share of tests
            passed).
        tests_column: the dataset column with the tests (see :func:`parse_code_tests`).
        cpu_seconds, wall_seconds: CPU and wall-clock time per test.
        completion_seconds: wall-clock time for all tests of one completion (tests not started by then fail).
        batch_seconds: wall-clock time for the whole batch; completions still running then are stopped and
            scored on the tests finished (all or nothing: 0), those not started score 0
            (``last_stats["cut_by_deadline"]`` counts them). ``None``: no batch deadline.
        memory_mb: address space per process.
        num_workers: sandboxes running at once; ``None``: the CPUs this process may use divided by the
            processes on this machine (``LOCAL_WORLD_SIZE``), at most 16.
        sandbox: a :class:`~trl_sae.rewards.sandbox.Sandbox` for full control (then ``cpu_seconds``,
            ``wall_seconds``, ``completion_seconds``, ``memory_mb`` and ``backend`` must be left at their
            defaults).
        name: the function's ``__name__`` (its metrics name).
        backend: what isolates the programs (``Sandbox.backend``): ``"namespaces"`` (the default),
            ``"bwrap"`` (bubblewrap; fails here, naming the fix, when it cannot run) or ``"auto"`` (bwrap
            where it runs, else namespaces). See docs/guides/code.md.

    Example:
        >>> fraction = make_code_reward(scoring="fraction", cpu_seconds=1.0, batch_seconds=60)
    """
    custom_limits = (cpu_seconds, wall_seconds, completion_seconds, memory_mb) != (2.0, 4.0, 30.0, 1024)
    if sandbox is not None and custom_limits:
        raise ValueError(
            "pass the limits either as cpu_seconds/wall_seconds/completion_seconds/memory_mb or inside "
            "`sandbox` (Sandbox(limits=SandboxLimits(...))), not both."
        )
    if sandbox is not None and backend != "namespaces":
        raise ValueError(
            "pass `backend` either to make_code_reward or inside `sandbox` (Sandbox(backend=...)), not both."
        )
    if sandbox is None:
        sandbox = Sandbox(
            limits=SandboxLimits(
                cpu_seconds=cpu_seconds,
                wall_seconds=wall_seconds,
                completion_seconds=completion_seconds,
                memory_mb=memory_mb,
            ),
            backend=backend,
        )
    return _CodeReward(
        sandbox=sandbox,
        scoring=scoring,
        tests_column=tests_column,
        num_workers=num_workers,
        batch_seconds=batch_seconds,
        name=name,
    )


_DEFAULT: _CodeReward | None = None
_DEFAULT_LOCK = threading.Lock()


def code_tests(
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None = None,
    tests: list[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 if the program in a completion's last fenced Python block passes all of the row's ``tests``, else 0.0.

    Each program runs sandboxed (Linux, as root: new namespaces, an unprivileged uid, no network; see
    docs/guides/code.md), every test with 2 s of CPU and 4 s of wall-clock time, a completion with 30 s,
    the batch with 120 s; several sandboxes run at once. A completion without a code block, a program
    that does not compile or a row whose tests are unusable scores 0.0, with the reason in the debug log
    (a reward made by :func:`make_code_reward` also keeps it in ``last_verdicts``). See
    :func:`make_code_reward` for the fraction of tests passed, other limits or another column.

    Raises:
        IsolationUnavailableError: the sandbox cannot isolate programs here (not root).

    Example:
        >>> code_tests(  # doctest: +SKIP
        ...     prompts=["..."],
        ...     completions=["```python\\nprint(sum(map(int, input().split())))\\n```"],
        ...     tests=['{"inputs": ["1 2\\\\n"], "outputs": ["3\\\\n"]}'],
        ... )
        [1.0]
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = make_code_reward()  # type: ignore[assignment]
    assert _DEFAULT is not None
    return _DEFAULT(prompts, completions, completion_ids, tests=tests, **kwargs)
