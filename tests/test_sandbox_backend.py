"""The code sandbox's ``backend`` setting: its values, the checks of ``backend="bwrap"`` and ``"auto"``'s choice.

What the bwrap backend isolates is tested by the hostile corpus (tests/test_code_sandbox.py), which runs every
case under both backends.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from trl_sae.rewards import _bwrap, make_code_reward
from trl_sae.rewards.sandbox import IsolationUnavailableError, Sandbox

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the code sandbox needs Linux")

BWRAP = shutil.which("bwrap")
IS_ROOT = os.geteuid() == 0
needs_working_bwrap = pytest.mark.skipif(
    BWRAP is None or not IS_ROOT,
    reason="needs bubblewrap (apt-get install bubblewrap) and root (CI has both)",
)


@pytest.fixture(autouse=True)
def fresh_trials():
    """Each test sees its own bwrap trial (they are cached per executable and interpreter)."""
    _bwrap.bwrap_unusable.cache_clear()
    yield
    _bwrap.bwrap_unusable.cache_clear()


def test_the_default_is_unchanged() -> None:
    assert Sandbox().backend == "namespaces" and Sandbox().resolved_backend == "namespaces"
    assert make_code_reward().sandbox.resolved_backend == "namespaces"  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ["docker", "BWRAP", "", None, True])
def test_a_bad_value_is_a_clear_error(value) -> None:
    with pytest.raises(ValueError, match=r"^`backend` must be 'namespaces' \(the default\), 'bwrap'"):
        Sandbox(backend=value)
    with pytest.raises(ValueError, match="`backend` must be"):
        make_code_reward(backend=value)


@pytest.mark.parametrize("backend", ["bwrap", "auto"])
def test_weakening_settings_are_refused_with_bwrap(backend: str) -> None:
    with pytest.raises(ValueError, match=f"backend='{backend}' always isolates.*namespaces=False"):
        Sandbox(backend=backend, namespaces=False)
    with pytest.raises(ValueError, match="drop_privileges=False are settings of backend='namespaces' only"):
        Sandbox(backend=backend, drop_privileges=False)


@pytest.mark.parametrize(
    ("bwrap", "reason"),
    [
        ("/nonexistent/bin/bwrap", "bubblewrap's `/nonexistent/bin/bwrap` was not found\\."),
        ("no-such-bwrap-3f9c", "bubblewrap's `no-such-bwrap-3f9c` was not found on PATH\\."),
    ],
)
def test_a_missing_bwrap_is_a_clear_error_at_construction(bwrap: str, reason: str) -> None:
    with pytest.raises(IsolationUnavailableError) as caught:
        Sandbox(backend="bwrap", bwrap=bwrap)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("Sandbox(backend='bwrap') cannot run here: ")
    assert re.search(reason, message), message
    assert "apt-get install bubblewrap" in message and "backend='namespaces'" in message


def test_the_reward_fails_when_made_not_at_its_first_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bwrap.shutil, "which", lambda name: None)  # no bwrap on PATH
    with pytest.raises(IsolationUnavailableError, match="`bwrap` was not found on PATH"):
        make_code_reward(backend="bwrap")
    assert make_code_reward(backend="auto").sandbox.resolved_backend == "namespaces"  # type: ignore[attr-defined]


@pytest.mark.skipif(BWRAP is None, reason="needs bubblewrap (apt-get install bubblewrap)")
def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bwrap.os, "geteuid", lambda: 1000)
    with pytest.raises(IsolationUnavailableError, match="cannot run here: the trainer is not root"):
        Sandbox(backend="bwrap")


@pytest.mark.skipif(not IS_ROOT, reason="as a normal user the trial stops at 'not root' before running bwrap")
def test_a_bwrap_that_cannot_run_is_a_clear_error_and_auto_falls_back(tmp_path: Path) -> None:
    # A bwrap that fails as one does in a container without the rights to make namespaces.
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(IsolationUnavailableError, match=r"a trial sandbox failed \(bwrap: No permissions"):
        Sandbox(backend="bwrap", bwrap=str(fake))
    assert Sandbox(backend="auto", bwrap=str(fake)).resolved_backend == "namespaces"
    assert Sandbox(backend="auto", bwrap="/nonexistent/bwrap").resolved_backend == "namespaces"


@needs_working_bwrap
def test_auto_picks_bwrap_where_it_runs_and_the_reward_scores_under_it() -> None:
    assert Sandbox(backend="auto").resolved_backend == "bwrap"
    reward = make_code_reward(backend="bwrap", num_workers=2)
    assert reward.sandbox.backend == "bwrap"  # type: ignore[attr-defined]
    tests = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    assert reward(["p", "p"], [right, wrong], tests=[tests, tests]) == [1.0, 0.0]
    assert reward.last_stats["leaked"] == 0  # type: ignore[attr-defined]


def test_backend_and_a_sandbox_together_are_refused() -> None:
    with pytest.raises(ValueError, match="pass `backend` either to make_code_reward or inside `sandbox`"):
        make_code_reward(backend="auto", sandbox=Sandbox())


@needs_working_bwrap
def test_a_bwrap_found_on_the_trainers_path_is_the_one_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launch runs with the sandbox's clean PATH (/usr/local/bin:/usr/bin:/bin): a bwrap found elsewhere on
    # the trainer's PATH must be launched by its full path, as the trial launched it.
    (tmp_path / "trl-sae-test-bwrap").symlink_to(BWRAP)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    sandbox = Sandbox(backend="bwrap", bwrap="trl-sae-test-bwrap")
    result = sandbox.run("print(int(input()) * 2)", "stdio", [{"input": "21"}])
    assert result.isolation is not None and result.isolation.get("backend") == "bwrap"
    assert result.records[0]["status"] == "ok" and result.records[0]["stdout_head"].strip() == "42"
