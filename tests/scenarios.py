"""Several two-rank scripts run one after the other in ONE ``accelerate launch``, for the tests that share it.

Starting a launch costs ~16 s of CPU before a script's first line (the launcher, then torch, transformers, TRL
and peft imported in each rank; measured with an empty script on the 2-core development machine). A module
whose tests each launched their own two ranks paid that per test. Here a module-scoped fixture runs the
scenarios its selected tests need in one launch; each test reads and checks its scenario's files as before.

Each scenario is the script it was (unchanged text, its own ``sys.argv`` and a fresh module namespace), run
with ``exec`` in the same two processes: the process group, accelerate's process-wide state and anything a
script patched stay for the next. Scenarios that end a rank (an error meant to stop the launch) keep a launch
of their own. The tests sharing a launch carry ``pytest.mark.xdist_group`` so that pytest-xdist sends them to
one worker (``make test`` runs ``--dist loadgroup``) and the launch runs once.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.test_distributed import END_PROCESS_GROUP, launch_env, run_launch, two_rank_command

RUNNER = """
import gc, json, sys
for _path, _args in json.loads(sys.argv[1]):
    sys.argv = [_path, *_args]
    with open(_path) as _handle:
        _code = compile(_handle.read(), _path, "exec")
    exec(_code, {"__name__": "__main__", "__file__": _path})
    gc.collect()
"""


def launch_scenarios(
    folder: Path,
    scenarios: Sequence[tuple[str, str, Sequence[str]]],
    *,
    fsdp: bool = False,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run ``scenarios`` (``(name, script text, script arguments)``, in order) in one two-rank launch: DDP, or
    FSDP2 with ``fsdp``. Each script is written to ``folder/<name>.py``; a hung rank is killed after
    ``timeout`` seconds (:func:`tests.test_distributed.run_launch`), and a failed launch fails the caller."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = []
    for name, text, arguments in scenarios:
        path = folder / f"{name}.py"
        path.write_text(text)
        plan.append([str(path), [str(a) for a in arguments]])
    runner = folder / "scenarios.py"
    runner.write_text(RUNNER + END_PROCESS_GROUP)
    result = run_launch(two_rank_command(runner, json.dumps(plan), fsdp=fsdp), launch_env(), timeout=timeout)
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
