"""The ``trl-sae`` command. Library modules never import from here."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CLIError": "app",
    "build_parser": "app",
    "config_table": "app",
    "main": "app",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
