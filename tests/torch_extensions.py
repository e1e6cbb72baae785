"""Where torch JIT-builds C++ extensions (DeepSpeed's CPU ops) for this checkout's tests: inside the virtualenv.

torch's default, ``~/.cache/torch_extensions/<python>_<torch>/``, is shared by every virtualenv of the user
with the same Python and torch versions, so one environment's half-done build (a test timeout killing it)
leaves a lock that hangs every other's next DeepSpeed test. ``make install-deepspeed-ops`` builds with
:func:`use_venv_extensions_dir` and ``tests/conftest.py`` calls it too, so the tests look where the build
went. A ``TORCH_EXTENSIONS_DIR`` already set wins; outside a virtualenv torch's default stays.
"""

from __future__ import annotations

import os
import sys

__all__ = ["PRESET", "use_venv_extensions_dir", "venv_extensions_dir"]

# The user's own TORCH_EXTENSIONS_DIR, read when tests/conftest.py imports this module (before it sets one).
PRESET = os.environ.get("TORCH_EXTENSIONS_DIR")


def venv_extensions_dir() -> str | None:
    """``<virtualenv>/torch_extensions`` for the running interpreter's virtualenv; None outside one."""
    if sys.prefix == sys.base_prefix:
        return None
    return os.path.join(sys.prefix, "torch_extensions")


def use_venv_extensions_dir() -> str | None:
    """Point ``TORCH_EXTENSIONS_DIR`` (read by torch when it builds or loads an extension) at
    :func:`venv_extensions_dir` unless it is set already; the folder in use (None: torch's default)."""
    folder = venv_extensions_dir()
    if folder is not None:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", folder)
    return os.environ.get("TORCH_EXTENSIONS_DIR")
