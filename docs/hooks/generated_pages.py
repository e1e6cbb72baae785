"""MkDocs hook: the site's pages made from files outside ``docs/`` at build time, so no copy can go stale.

* ``index.md`` (the home page) is the repository's ``README.md`` (also the PyPI page), its links into
  ``docs/`` made relative to the site, since the README's links are relative to the repository's root.
* ``benchmarks/README.md`` is ``benchmarks/README.md`` with the plots it shows (``benchmarks/results/...``), at
  the same path, so the README's link to it works on the site as in the repository.

``mkdocs build --strict`` then checks their links like any other page's.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = "benchmarks/README.md"


def readme_for_site(text: str) -> str:
    """The README as the site's home page: ``](docs/x.md)`` becomes ``](x.md)`` (links elsewhere are kept)."""
    return re.sub(r"\]\(docs/", "](", text)


def benchmark_images(text: str) -> list[str]:
    """The files under ``benchmarks/results/`` that benchmarks/README.md links to, relative to its folder."""
    return sorted(set(re.findall(r"\]\((results/[^)\s]+)\)", text)))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages (MkDocs calls this once its own files under docs/ are collected)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=readme_for_site(readme)))
    benchmarks = ROOT / BENCHMARKS
    files.append(File.generated(config, BENCHMARKS, abs_src_path=str(benchmarks)))
    for image in benchmark_images(benchmarks.read_text(encoding="utf-8")):
        source = benchmarks.parent / image
        if source.is_file():  # a missing one stays a broken link, which --strict reports
            files.append(File.generated(config, f"benchmarks/{image}", abs_src_path=str(source)))
    return files
