"""Several two-rank scripts run one after the other in ONE ``accelerate launch``, for the tests that share it.

Starting a launch costs ~16 s of CPU before a script's first line (the launcher, then torch, transformers, TRL
and peft imported in each rank; measured with an empty script on the 2-core development machine). A module
whose tests each launched their own two ranks paid that per test. Here a module-scoped fixture runs the
scenarios its selected tests need in one launch; each test reads and checks its scenario's files as before.

``DDP_SCENARIOS`` lists the passing DDP runs of several modules, which share one launch for the whole session
(fixture ``ddp_launch``, tests marked with :func:`in_the_ddp_launch`); a module whose runs need another setup
(FSDP2, tests/test_fsdp.py) has a fixture of its own.

Each scenario is the script it was (unchanged text, its own ``sys.argv`` and a fresh module namespace), run
with ``exec`` in the same two processes: the process group, accelerate's process-wide state and anything a
script patched stay for the next. Scenarios that end a rank (an error meant to stop the launch) keep a launch
of their own. The launch runs once per test run, on whichever pytest-xdist worker first needs it
(:func:`once_per_run`); the tests sharing it carry one ``pytest.mark.xdist_group``, which orders them
(tests/durations.py) and, once pytest-xdist honours groups again, keeps them on one worker.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

RUNNER = """
import gc, json, sys
for _path, _args in json.loads(sys.argv[1]):
    sys.argv = [_path, *_args]
    with open(_path) as _handle:
        _code = compile(_handle.read(), _path, "exec")
    exec(_code, {"__name__": "__main__", "__file__": _path})
    gc.collect()
"""


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """``make(folder)`` once for the whole test run, whichever pytest-xdist worker asks first; the others (and
    later asks) wait for it and get the same folder. A failed ``make`` fails every ask with its message.

    pytest-xdist 3.8's ``--dist loadgroup`` does not keep an ``xdist_group`` on one worker under pytest 9.2
    (pytest-dev/pytest-xdist#1386: it marks groups by rewriting node ids, which pytest 9.2 no longer reads),
    so the tests sharing a launch may run on both workers: the folder is shared through the run's temporary
    root (both workers' base folders are in it), behind a file lock. tests/durations.py sends the first test
    of such a group early and the others at the end, so the second worker seldom waits.
    """
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, failed = root / name, root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if failed.exists():
            pytest.fail(failed.read_text(), pytrace=False)
        if not (folder / ".done").exists():
            folder.mkdir(exist_ok=True)
            try:
                make(folder)
            except BaseException as error:
                failed.write_text(f"{name}: {error}")
                raise
            (folder / ".done").touch()
    return folder


def write_scenarios(folder: Path, scenarios: Sequence[tuple[str, str, Sequence[str]]]) -> list[str]:
    """Write each scenario's script (``(name, script text, script arguments)``) to ``folder/<name>.py`` and the
    runner that execs them in order; returns the runner's command-line tail (script path, plan) for a launcher.
    """
    # Imported here: tests.test_distributed imports this module for its marks.
    from tests.test_distributed import END_PROCESS_GROUP

    folder.mkdir(parents=True, exist_ok=True)
    plan = []
    for name, text, arguments in scenarios:
        path = folder / f"{name}.py"
        path.write_text(text)
        plan.append([str(path), [str(a) for a in arguments]])
    runner = folder / "scenarios.py"
    runner.write_text(RUNNER + END_PROCESS_GROUP)
    return [str(runner), json.dumps(plan)]


def launch_scenarios(
    folder: Path,
    scenarios: Sequence[tuple[str, str, Sequence[str]]],
    *,
    fsdp: bool = False,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run ``scenarios`` (``(name, script text, script arguments)``, in order) in one two-rank accelerate launch:
    DDP, or FSDP2 with ``fsdp``. A hung rank is killed after ``timeout`` seconds
    (:func:`tests.test_distributed.run_launch`), and a failed launch fails the caller."""
    from tests.test_distributed import launch_env, run_launch, two_rank_command

    runner, plan = write_scenarios(folder, scenarios)
    result = run_launch(two_rank_command(Path(runner), plan, fsdp=fsdp), launch_env(), timeout=timeout)
    names = ", ".join(name for name, _, _ in scenarios)
    assert result.returncode == 0, f"the launch of {names} failed:\n{result.stderr[-4000:]}"
    return result


def selected_scenarios(
    request: pytest.FixtureRequest,
    scenarios: Sequence[str],
    scenarios_of: Callable[[pytest.Item], Sequence[str]],
) -> list[str]:
    """Those of ``scenarios`` (in their order) that the selected tests of the requesting fixture's module
    that use it need: a run of one test (``-k``, a node id) launches only its own."""
    needed = {
        name
        for item in request.session.items
        if getattr(item, "module", None) is request.module and request.fixturename in item.fixturenames
        for name in scenarios_of(item)
    }
    unknown = needed - set(scenarios)
    assert not unknown, f"no scenario {sorted(unknown)}"
    return [name for name in scenarios if name in needed]


# The passing two-rank DDP runs of several modules: one launch for the session (fixture `ddp_launch` in
# tests/conftest.py) instead of one per module. name: (module, its script's attribute, the script's arguments
# after the folder it writes into, ddp_launch / name).
DDP_SCENARIOS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "distributed_gather": ("tests.test_distributed", "SCRIPT", ()),
    "distributed_split": ("tests.test_distributed", "SPLIT_SCRIPT", ()),
    "distributed_few_units": ("tests.test_distributed", "FEW_UNITS_SCRIPT", ()),
    "distributed_whiten": ("tests.test_distributed", "WHITEN_SCRIPT", ()),
    "dynamic_sampling_ddp": ("tests.test_dynamic_sampling", "TWO_RANK_SCRIPT", ("ddp",)),
    "dynamic_sampling_always": ("tests.test_dynamic_sampling", "TWO_RANK_SCRIPT", ("ddp", "always")),
    "checkpointing_fall_back": ("tests.test_checkpointing", "TWO_RANK_SCRIPT", ()),
    "rlvr_knobs": ("tests.test_rlvr_knobs", "TWO_RANK_SCRIPT", ()),
    "shared_prefix": ("tests.test_shared_prefix", "DDP_SCRIPT", ()),
}
DDP_LAUNCH_GROUP = "ddp_launch"


def ddp_launch_marks(scenario: str) -> list[pytest.MarkDecorator]:
    """The marks of a test that reads ``scenario``'s folder of the shared DDP launch: which scenario, one
    xdist_group for all of them (tests/durations.py orders it), slow, and a timeout that covers the
    launch (pytest-timeout counts the fixture's set-up in the first test's time)."""
    assert scenario in DDP_SCENARIOS, scenario
    return [
        pytest.mark.ddp_scenario(scenario),
        pytest.mark.xdist_group(DDP_LAUNCH_GROUP),
        pytest.mark.slow,
        pytest.mark.timeout(1200),
    ]


def in_the_ddp_launch(scenario: str) -> Callable:
    """Decorator form of :func:`ddp_launch_marks`."""

    def decorate(test):
        for mark in ddp_launch_marks(scenario):
            test = mark(test)
        return test

    return decorate


def run_ddp_launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the scenarios the session's selected tests name (``ddp_scenario`` marks), in DDP_SCENARIOS' order,
    in one launch for the run (:func:`once_per_run`); ``folder / name`` holds each one's files and
    ``folder / "stderr.txt"`` the launch's stderr."""
    import importlib

    needed = set()
    for item in request.session.items:
        mark = item.get_closest_marker("ddp_scenario")
        if mark is not None:
            needed.add(mark.args[0])

    def launch(root: Path) -> None:
        scenarios = []
        for name, (module, attribute, arguments) in DDP_SCENARIOS.items():
            if name in needed:
                (root / name).mkdir()
                text = getattr(importlib.import_module(module), attribute)
                scenarios.append((name, text, [root / name, *arguments]))
        result = launch_scenarios(root / "scripts", scenarios, timeout=1200)
        (root / "stderr.txt").write_text(result.stderr)

    return once_per_run(tmp_path_factory, "ddp_launch", launch)
