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
BENCHMARKS = ROOT / "benchmarks"


def _benchmark_pages() -> set[str]:
    """The benchmark pages the hook publishes and the nav lists: the index, the results page, every experiment page
    and every archive page (the hook's BENCHMARK_PAGES, read from the disk so these tests run without mkdocs)."""
    experiments = {p.relative_to(ROOT).as_posix() for p in (BENCHMARKS / "experiments").rglob("*.md")}
    return {"benchmarks/README.md", "benchmarks/RESULTS.md"} | experiments


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
    assert "docs/reference/config.md" in links and "benchmarks/RESULTS.md" in links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target = link.split("#")[0]
        # On the site the README is the home page: only docs/ and the benchmark pages exist there.
        assert target.startswith("docs/") or target in _benchmark_pages(), link
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
    # index.md and the benchmark pages are made by the hook from README.md and benchmarks/.
    assert nav == on_disk | {"index.md"} | _benchmark_pages()
    assert {"design.md", "reference/config.md"} <= on_disk
    assert config["hooks"] == ["docs/hooks/generated_pages.py"]
    # Results -> the summary first, every experiment page, the archives in their own section, the index last.
    (results,) = [item["Results"] for item in config["nav"] if "Results" in item]
    experiments = {p for p in _benchmark_pages() if p.startswith("benchmarks/experiments/")}
    archives = {p for p in experiments if p.startswith("benchmarks/experiments/archive/")}
    (archive,) = [item["Archive"] for item in results if "Archive" in item]
    assert set(flatten(archive)) == archives and archives
    assert set(flatten(results)) == experiments | {"benchmarks/RESULTS.md", "benchmarks/README.md"}
    assert list(results[0].values()) == ["benchmarks/RESULTS.md"]
    assert list(results[-1].values()) == ["benchmarks/README.md"]


def test_every_experiment_page_is_reachable_and_every_archive_has_its_experiment():
    """The results page links every experiment page, the index every page, and each archive belongs to an
    experiment page that links to it (an archive is never the only home of a result)."""

    def links(path: str) -> set[str]:
        folder = (ROOT / path).parent
        targets = {link.split("#")[0] for link in _links((ROOT / path).read_text(encoding="utf-8"))}
        return {(folder / t).resolve().relative_to(ROOT).as_posix() for t in targets if t and "://" not in t}

    experiments = {p for p in _benchmark_pages() if p.startswith("benchmarks/experiments/")}
    archives = {p for p in experiments if "/archive/" in p}
    assert experiments - archives <= links("benchmarks/RESULTS.md")
    assert experiments | {"benchmarks/RESULTS.md"} <= links("benchmarks/README.md")
    for archive in archives:
        page = archive.replace("/archive/", "/")
        assert page in experiments, f"{archive} archives no experiment page"
        assert archive in links(page) and page in links(archive), archive
        assert "benchmarks/RESULTS.md" in links(page), page


def test_benchmark_index_lists_every_script():
    """benchmarks/README.md's Scripts list names every benchmark script, one line each."""
    text = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    scripts = text.split("\n## Scripts\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `([\w.]+\.py)`", scripts, flags=re.MULTILINE))
    on_disk = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    assert on_disk <= listed, on_disk - listed


def test_the_home_page_is_the_readme_with_site_links():
    hook = _hook()
    text = "[a](docs/guides/vllm.md#limits) [b](benchmarks/README.md) [c](https://x.org/docs/y)"
    assert (
        hook.readme_for_site(text)
        == "[a](guides/vllm.md#limits) [b](benchmarks/README.md) [c](https://x.org/docs/y)"
    )
    bench = "![curve](results/a/b.png) and ![again](results/a/b.png#x), [c](../c.md) `results/d.png` [w](https://x.org)"
    assert hook.relative_links(bench) == ["../c.md", "results/a/b.png"]
    assert set(hook.benchmark_pages()) == _benchmark_pages()


def test_the_hook_publishes_what_a_benchmark_page_links_to(tmp_path):
    hook = _hook()
    (tmp_path / "benchmarks" / "results" / "a").mkdir(parents=True)
    for name in ("results/a/plot.png", "results/a/results.md", "README.md"):
        (tmp_path / "benchmarks" / name).write_text("x")
    text = "[t](../results/a/results.md) ![p](../results/a/plot.png) [gone](../results/a/gone.png) [i](../README.md)"
    # resolved against the page's folder; a missing file is left out (strict reports the broken link)
    assert hook.linked_benchmark_files("benchmarks/experiments/x.md", text, root=tmp_path) == [
        "benchmarks/README.md",
        "benchmarks/results/a/plot.png",
        "benchmarks/results/a/results.md",
    ]
    assert (
        hook.linked_benchmark_files("benchmarks/experiments/x.md", "[d](../../docs/x.md)", root=tmp_path)
        == []
    )


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
    assert "bench_advantages.py" in benchmarks and 'href="../benchmarks/RESULTS/"' not in benchmarks
    results = (site / "benchmarks" / "RESULTS" / "index.html").read_text(encoding="utf-8")
    assert "Does SAE help?" in results and 'href="../experiments/known-error-critic-issue30/' in results
    speed = (site / "benchmarks" / "experiments" / "speed" / "index.html").read_text(encoding="utf-8")
    assert "Advantage estimators" in speed
    assert (site / "benchmarks" / "experiments" / "archive" / "long-horizon" / "index.html").is_file()
    assert (site / "benchmarks" / "results" / "real_model" / "curves.png").is_file()
    # a results.md table the sweep script wrote, published as a page outside the nav
    assert (site / "benchmarks" / "results" / "real_model" / "fresh" / "results" / "index.html").is_file()
    config = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    assert "segment_threshold" in config


def test_site_build_fails_on_a_broken_link(tmp_path):
    """--strict is what makes a broken link a failure: a copy of the site with one bad link must not build."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra installs it)")
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    # the benchmark pages with their plots and tables (not the runs, logs and JSON): the one bad link is the only fault
    shutil.copytree(
        BENCHMARKS, copy / "benchmarks", ignore=shutil.ignore_patterns("runs", "*.py", "*.log", "*.json")
    )
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
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert warnings and all("no_such_page.md" in line for line in warnings), warnings
