"""Print a pip constraints file that pins every direct dependency to its declared floor.

    python .ci/min_constraints.py > min.txt
    pip install -c min.txt dist/trl_sae-*.whl

`.ci/run` installs the package under these constraints in a fresh virtualenv and runs the core tests, so a
floor in pyproject.toml is a tested fact, not a guess. A dependency with no lower bound (tqdm, rich, ...) is
left to the resolver. Packages named with --skip keep their floor unpinned: torch, whose declared floor
(2.6) has no CPU-only build on PyPI, so CI uses the CPU torch it already has and its floor is the one
transformers itself enforces.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def floors(pyproject: Path, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """{distribution name: lowest version allowed by its `>=` or `==` specifier} for the runtime deps."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    found: dict[str, str] = {}
    for line in requirements:
        requirement = Requirement(line)
        lows = [spec.version for spec in requirement.specifier if spec.operator in (">=", "==", "~=")]
        if len(lows) > 1:
            raise SystemExit(f"{line!r}: more than one lower bound; keep one so its floor is unambiguous.")
        if lows:
            found[requirement.name] = lows[0]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    parser.add_argument("--extra", action="append", default=[], help="also pin this extra's floors")
    parser.add_argument("--skip", action="append", default=[], help="leave this package unpinned")
    args = parser.parse_args(argv)
    pins = floors(args.pyproject, tuple(args.extra))
    unknown = sorted(set(args.skip) - set(pins))
    if unknown:
        parser.error(f"--skip {', '.join(unknown)}: not a dependency with a floor")
    for name, version in pins.items():
        if name not in args.skip:
            sys.stdout.write(f"{name}=={version}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
