"""The ``trl-sae`` command: ``app`` (the parser and entry point), one module per command (``demo``,
``train``, ``eval``, ``segments``, ``correlate``, ``segstats``, ``docs``) and ``common`` (shared helpers).
Library modules never import from here."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CLIError": "common",
    "build_parser": "app",
    "config_table": "docs",
    "main": "app",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
