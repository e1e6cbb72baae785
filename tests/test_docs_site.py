"""The README and the documentation site (mkdocs.yml, docs/): a short README whose links lead somewhere, pages
that name only files, commands and make targets that exist, and a site that builds with --strict."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HOOK = ROOT / "docs" / "hooks" / "generated_pages.py"


def _pages() -> list[Path]:
    """The README and every Markdown page under docs/."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _code(text: str) -> str:
    """The code blocks and inline code of a Markdown text, one per line."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    commands = re.sub(r"(^|\s)#.*", "", "\n".join(blocks))  # a shell comment is prose too
    return "\n".join([commands, *re.findall(r"`([^`\n]+)`", prose)])


def _expand(path: str) -> list[str]:
    """``a/{b,c}.yaml`` -> ``a/b.yaml``, ``a/c.yaml`` (the docs name a family of files that way)."""
    match = re.search(r"\{([^}]*)\}", path)
    if match is None:
        return [path]
    return [
        p for part in match[1].split(",") for p in _expand(path[: match.start()] + part + path[match.end() :])
    ]


def _hook():
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra installs it)")
    spec = importlib.util.spec_from_file_location("generated_pages", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short_and_links_only_to_files_that_exist():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "the README is the five-minute read: move detail into docs/guides/"
    links = _links(text)
    assert "docs/reference/config.md" in links and "benchmarks/README.md" in links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target = link.split("#")[0]
        # On the site the README is the home page: only docs/ and benchmarks/README.md exist there.
        assert target.startswith("docs/") or target == "benchmarks/README.md", link
        assert (ROOT / target).is_file(), link


def test_documented_files_exist():
    pattern = re.compile(r"(?<![\w/.])((?:examples|benchmarks|tests|trl_sae|\.ci|\.github)/[\w./{},*-]*\w)")
    named = {
        (page.name, path) for page in _pages() for path in pattern.findall(page.read_text(encoding="utf-8"))
    }
    assert len(named) > 30  # sanity: the pages name the recipes, benchmarks and tests they describe
    for page, path in sorted(named):
        for one in _expand(path):
            assert glob.glob(str(ROOT / one)), f"{page} names {one}, which does not exist"


def test_documented_commands_and_make_targets_exist():
    from trl_sae.cli.app import COMMANDS

    commands = {module.__name__.rsplit(".", 1)[1] for module in COMMANDS} | {"eval"}
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE))
    used_commands, used_targets = set(), set()
    for page in _pages():
        code = _code(page.read_text(encoding="utf-8"))  # prose says "trl-sae requires ..."
        used_commands |= set(re.findall(r"\btrl-sae ([a-z][\w-]*)", code))
        used_targets |= set(re.findall(r"\bmake ([a-z][\w-]*)", code))
    assert {"demo", "train", "eval", "docs"} <= used_commands <= commands, used_commands - commands
    assert {"install", "test", "docs", "lint", "dist"} <= used_targets <= targets, used_targets - targets


def test_nav_lists_every_page_and_the_generated_ones():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def flatten(items):
        for item in items:
            for value in item.values():
                yield from flatten(value) if isinstance(value, list) else [value]

    nav = set(flatten(config["nav"]))
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    # index.md and benchmarks/README.md are made by the hook from README.md and benchmarks/README.md.
    assert nav == on_disk | {"index.md", "benchmarks/README.md"}
    assert {"design.md", "reference/config.md"} <= on_disk
    assert config["hooks"] == ["docs/hooks/generated_pages.py"]


def test_the_home_page_is_the_readme_with_site_links():
    hook = _hook()
    text = "[a](docs/guides/vllm.md#limits) [b](benchmarks/README.md) [c](https://x.org/docs/y)"
    assert (
        hook.readme_for_site(text)
        == "[a](guides/vllm.md#limits) [b](benchmarks/README.md) [c](https://x.org/docs/y)"
    )
    bench = "![curve](results/a/b.png) and ![again](results/a/b.png), [c](results/c.png) `results/d.png`"
    assert hook.benchmark_images(bench) == ["results/a/b.png", "results/c.png"]


def test_site_builds_strict_with_the_generated_pages(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra installs it)")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "Segmental Advantage Estimation" in home and 'href="guides/install/' in home
    benchmarks = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "Advantage estimators" in benchmarks
    assert (site / "benchmarks" / "results" / "real_model" / "curves.png").is_file()
    config = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    assert "segment_threshold" in config


def test_site_build_fails_on_a_broken_link(tmp_path):
    """--strict is what makes a broken link a failure: a copy of the site with one bad link must not build."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra installs it)")
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    (copy / "benchmarks").mkdir()
    (copy / "benchmarks" / "README.md").write_text("# Benchmarks\n")
    page = copy / "docs" / "guides" / "phases.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no_such_page.md).\n")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=copy,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode != 0
    assert "no_such_page.md" in result.stderr
