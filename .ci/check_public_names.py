"""Import every public name of trl_sae and of each of its modules; exit 1 naming those that fail.

Run from outside the source tree against an installed trl-sae (.ci/check_wheel.sh does), so a module or
file missing from the wheel cannot be masked by the checkout. Also checks that the installed
distribution's version is the package's __version__.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import sys

import trl_sae


def main() -> int:
    failures: list[str] = []
    checked = 0
    modules = [trl_sae]
    for info in pkgutil.walk_packages(trl_sae.__path__, prefix="trl_sae."):
        try:
            modules.append(importlib.import_module(info.name))
        except Exception as error:
            failures.append(f"{info.name}: {type(error).__name__}: {error}")
    for module in modules:
        names = getattr(module, "__all__", None)
        if names is None:
            failures.append(f"{module.__name__}: no __all__")
            continue
        for name in names:
            try:
                getattr(module, name)
            except Exception as error:  # report every failure, not just the first
                failures.append(f"{module.__name__}.{name}: {type(error).__name__}: {error}")
            checked += 1
    installed = importlib.metadata.version("trl-sae")
    if installed != trl_sae.__version__:
        failures.append(
            f"installed distribution is {installed}, trl_sae.__version__ is {trl_sae.__version__}"
        )
    print(
        f"trl_sae {trl_sae.__version__} from {trl_sae.__file__}: {checked} public names in {len(modules)} modules"
    )
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
