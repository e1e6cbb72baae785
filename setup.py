"""The package's long description (the PyPI page): README.md with its repository-relative links made absolute.

Everything else is in pyproject.toml; this file exists because setuptools can read a readme file but not
rewrite it. README.md links into the repository (``docs/guides/install.md``, ``benchmarks/README.md#...``),
which works on the repository's web view and on the documentation site (docs/hooks/generated_pages.py) but
leads nowhere on PyPI. Here each such link becomes the page's address on the documentation site, from
``site_url`` in mkdocs.yml: ``docs/guides/install.md#x`` is ``<site_url>guides/install/#x`` (MkDocs'
directory URLs), ``benchmarks/experiments/critics.md`` is ``<site_url>benchmarks/experiments/critics/`` and
``benchmarks/README.md`` is ``<site_url>benchmarks/``. While mkdocs.yml has no
``site_url`` (the project has no public home yet, see docs/guides/development.md), or for a link to a file
that is no page of the site, the link is dropped and its text kept: plain text rather than a dead link.
Absolute links (``https://...``) and in-page anchors (``#...``) are kept as they are. Stdlib only: it runs
in the isolated build environment, where only setuptools is installed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# [text](target) and ![alt](target), the target without spaces (the README writes no titles); code (fenced
# blocks, inline spans) is matched first and kept as written, so `funcs[0](x)` in an example stays code.
_LINK = re.compile(
    r"(?P<code>```.*?```|`[^`\n]*`)"
    r"|(?P<image>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)",
    re.DOTALL,
)
_ABSOLUTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)


def site_url(mkdocs_yml: str) -> str | None:
    """``site_url`` of mkdocs.yml (ending in ``/``), or None when it is not set."""
    match = re.search(r"^site_url:[ \t]*['\"]?([^'\"\s#]+)", mkdocs_yml, re.MULTILINE)
    return match.group(1).rstrip("/") + "/" if match else None


def site_page(path: str) -> str | None:
    """The site's address of a repository file, relative to the site's root; None for no page of it.

    The site's pages are the Markdown files under ``docs/`` (at their path below it) and the benchmark pages
    under ``benchmarks/`` (published at their repository path by docs/hooks/generated_pages.py); a
    ``README.md`` or ``index.md`` is its folder's page.
    """
    if not path.endswith(".md") or ".." in path.split("/"):
        return None
    if path.startswith("docs/"):
        page = path[len("docs/") : -len(".md")]
    elif path.startswith("benchmarks/"):
        page = path[: -len(".md")]
    else:
        return None
    folder, _, name = page.rpartition("/")
    if name in ("README", "index"):
        return f"{folder}/" if folder else ""
    return page + "/"


def absolute_links(markdown: str, site: str | None) -> str:
    """``markdown`` with every repository-relative link made a link to the site (``site``: its root, ending
    in ``/``), or its plain text when there is no site or no page of it."""

    def rewrite(match: re.Match[str]) -> str:
        target = match.group("target")
        if match.group("code") is not None or _ABSOLUTE.match(target):
            return match.group(0)
        path, _, fragment = target.partition("#")
        page = site_page(path) if site is not None else None
        if page is None:
            return match.group("text")
        return (
            f"{match.group('image')}[{match.group('text')}]({site}{page}{'#' + fragment if fragment else ''})"
        )

    return _LINK.sub(rewrite, markdown)


def long_description(root: Path = ROOT) -> str:
    """README.md for PyPI (see the module doc)."""
    mkdocs = root / "mkdocs.yml"
    site = site_url(mkdocs.read_text(encoding="utf-8")) if mkdocs.is_file() else None
    return absolute_links((root / "README.md").read_text(encoding="utf-8"), site)


if __name__ == "__main__":
    from setuptools import setup

    setup(long_description=long_description(), long_description_content_type="text/markdown")
