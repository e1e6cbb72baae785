"""MkDocs hook: the site's pages made from files outside ``docs/`` at build time, so no copy can go stale.

* ``index.md`` (the home page) is the repository's ``README.md`` (also the PyPI page), its links into
  ``docs/`` made relative to the site, since the README's links are relative to the repository's root.
* The benchmark pages (``BENCHMARK_PAGES``: ``benchmarks/README.md``, the results page ``benchmarks/RESULTS.md``
  and the experiment pages and their archives under ``benchmarks/experiments/``) are published at the same
  paths, so their links to each other work on the site as in the repository. Each is in the nav.
* Every file under ``benchmarks/`` that one of them links to (the plots, the ``results.md`` tables the sweep
  scripts write), and every file those tables link to, is published at its own path too; the tables are pages
  outside the nav.

``mkdocs build --strict`` then checks their links like any other page's.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK_PAGES = ("benchmarks/README.md", "benchmarks/RESULTS.md", "benchmarks/experiments/**/*.md")


def readme_for_site(text: str) -> str:
    """The README as the site's home page: ``](docs/x.md)`` becomes ``](x.md)`` (links elsewhere are kept)."""
    return re.sub(r"\]\(docs/", "](", text)


def relative_links(text: str) -> list[str]:
    """The relative link targets of a Markdown text, without their ``#anchor`` (web and in-page links left out)."""
    targets = {link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text)}
    return sorted(t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t))


def benchmark_pages(root: Path = ROOT) -> list[str]:
    """The benchmark pages the nav lists, as paths from the repository's root."""
    return sorted({p.relative_to(root).as_posix() for pattern in BENCHMARK_PAGES for p in root.glob(pattern)})


def linked_benchmark_files(page: str, text: str, root: Path = ROOT) -> list[str]:
    """The files under ``benchmarks/`` that ``page`` (a path from the root) links to, as paths from the root.
    A link to a missing file is kept out: it stays a broken link, which --strict reports."""
    folder = posixpath.dirname(page)
    found = []
    for link in relative_links(text):
        target = posixpath.normpath(posixpath.join(folder, link))
        if target.startswith("benchmarks/") and (root / target).is_file():
            found.append(target)
    return found


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages (MkDocs calls this once its own files under docs/ are collected)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=readme_for_site(readme)))
    pages = benchmark_pages()
    published = set(pages)
    for page in pages:
        files.append(File.generated(config, page, abs_src_path=str(ROOT / page)))
    todo = list(pages)
    while todo:  # the pages' plots and tables, then what the tables link to
        page = todo.pop()
        for target in linked_benchmark_files(page, (ROOT / page).read_text(encoding="utf-8")):
            if target in published:
                continue
            published.add(target)
            inclusion = InclusionLevel.NOT_IN_NAV if target.endswith(".md") else InclusionLevel.UNDEFINED
            files.append(File.generated(config, target, abs_src_path=str(ROOT / target), inclusion=inclusion))
            if target.endswith(".md"):
                todo.append(target)
    return files
