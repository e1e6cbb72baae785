"""The package's architecture, read from its source with ``ast`` (issue 33: the trainer as parts with narrow
interfaces). Nothing is imported or run: each check reads the ``trl_sae`` that Python would import.

(a) No module of ``trl_sae/trainer/`` but ``__init__.py`` imports ``sae_ppo_trainer``: the trainer is built
    from its parts, never the other way round (a ``TYPE_CHECKING`` import counts: it is the same dependency).
(b) No module uses another module's underscore names: no ``from trl_sae.x import _name``, no
    ``module._name``, and no ``obj._name`` where ``_name`` is defined by another ``trl_sae`` module and not by
    this one (a module's own privates are fine, ``self._x`` always). A private *module* (``_lazy``,
    ``_quiet``, ``rewards._verify_worker``) is private to the package, not to a module: importing its public
    names is fine. Third-party privates are allowed only as listed in :data:`THIRD_PARTY_PRIVATES`, each with
    why no public spelling exists.
(c) The layering of docs/design.md ("Where each job lives") holds: a part imports only its own layer and the
    layers below (:data:`LAYERS`), the parts' import graph has no cycle, and ``core/`` imports neither TRL
    nor transformers.
(d) No import circle between any two modules of the package (issue 49), and inside ``trainer/`` the
    sub-packages keep their own layering (:data:`TRAINER_LAYERS`).
(e) No module is longer than :data:`MAX_MODULE_LINES` (the trainer itself :data:`MAX_TRAINER_LINES`): past
    that a module holds more than one job.
(f) Every module, packages included, assigns ``__all__`` at its top level: CI's wheel check
    (``.ci/check_public_names.py``) imports each public name of each installed module and fails on a module
    without one, and this finds it in ``make test`` first.

Each checker is also run on a small planted package (``test_*_finds_a_planted_*``), so a check that stopped
looking would fail.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import trl_sae

PACKAGE_ROOT = Path(trl_sae.__file__).resolve().parent
PACKAGE = "trl_sae"

# Attribute names of other libraries' privates the package uses, with why: each has no public spelling in the
# library versions the package supports. A new one needs a reason here.
THIRD_PARTY_PRIVATES: dict[str, str] = {
    "_exit": "os._exit is the documented way for a forked child to end without running the parent's "
    "clean-up; the code sandbox's launcher forks its harness and test children",
    "_SubParsersAction": "argparse's type of add_subparsers()'s result, exported under no public name; "
    "the CLI annotates its subcommands' `register(subparsers)` with it",
    "_actions": "argparse.ArgumentParser's list of options has no public accessor; recipe.py names the "
    "fields closest to an unknown recipe key from it",
    "_get_fsdp_state": "torch FSDP2's root state: generation/sharding.py runs its lazy init before a child "
    "module's forward would claim the root role (FSDP2 has no public init)",
    "_lazy_init": "torch FSDP2's root initialisation, see _get_fsdp_state",
    "_read_metadata": "transformers' GGUF header reader (integrations/gguf/reader.py) walks a file's metadata "
    "for GgufHeader.from_file, whose last step refuses the tensor types only transformers' own unpacker "
    "lacks; gguf.py's check_gguf_file reads the tensor table of files the gguf package loads (Q5_0, ...) "
    "with the same two steps, no public spelling giving the types and offsets without that refusal",
    "_read_tensor_table": "the second of the two steps of transformers' GGUF header reader, see _read_metadata",
    "_sample": "transformers' GenerationMixin._sample is the sampling loop generate() dispatches to; "
    "generation/capture.py calls it with its own logits processors to capture log-probs while sampling",
    "_set_sync_gradients": "accelerate's GradientState has no public setter: the update sets gradient "
    "synchronisation per micro-batch because processes may run different numbers of them (token budget)",
}

# The parts of docs/design.md's layout, lowest first: a part may import its own layer and the layers below.
# "trl_sae" is the package's __init__ (it exports every layer's names lazily; only the CLI imports it).
LAYERS: list[set[str]] = [
    {"_lazy", "_quiet", "_moved"},
    {"core"},
    {"generation", "hub"},
    {"analysis", "code_data", "code_packaged", "code_tasks", "data", "evaluation", "gguf", "gym"},
    {"rewards", "stem"},  # stem.py reads boxed answers with rewards.format; no reward imports stem
    {"trainer"},
    {"recipe", "code_recipe"},  # code_recipe: the code datasets of recipes and trl-sae eval
    {"demo", "trl_sae"},
    {"cli"},
]

# The trainer's sub-packages and top modules (docs/guides/layout.md), lowest first: the same rule inside trainer/.
TRAINER_LAYERS: list[set[str]] = [
    {"__init__", "trl_base", "rollout_batch"},  # __init__: the package's lazy exports (nothing imports it)
    {"config"},
    {"objectives", "setup"},
    {"critics", "checkpoints"},
    {"parts"},
    {"sae_ppo_trainer"},
]
MAX_MODULE_LINES = 700
MAX_TRAINER_LINES = 800  # trainer/sae_ppo_trainer.py: the phases in order, each a short overridable method

# What core/ may not import (docs/design.md: "core/ never imports TRL or transformers, so any framework can
# reuse the math"); the other frameworks are listed as they would tie it to one just the same.
CORE_FORBIDDEN = {"trl", "transformers", "peft", "accelerate", "deepspeed", "vllm", "datasets"}


# --------------------------------------------------------------------------------------------------
# Reading the source
# --------------------------------------------------------------------------------------------------
@dataclass
class Module:
    name: str  # dotted, e.g. trl_sae.trainer.critics.policy_and_critic ("trl_sae" for the package's __init__)
    path: Path
    tree: ast.Module
    is_package: bool

    @property
    def part(self) -> str:
        """The part of the layout: the first name below the package (``core``, ``hub``, ...)."""
        pieces = self.name.split(".")
        return pieces[1] if len(pieces) > 1 else pieces[0]


def read_package(root: Path, package: str = PACKAGE) -> dict[str, Module]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        pieces = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = pieces[-1] == "__init__"
        name = ".".join(pieces[:-1] if is_package else pieces)
        modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module: Module, modules: dict[str, Module]) -> set[str]:
    """Every module of the package that ``module`` imports, anywhere in it (functions and TYPE_CHECKING too)."""
    found: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            found.add(source)
            found.update(
                f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules
            )
    return {name for name in found if name in modules}


def third_party_imports(module: Module) -> set[str]:
    """The top-level names of the libraries ``module`` imports (the package itself and relative imports left out)."""
    found: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {PACKAGE, "__future__"} - set(sys.stdlib_module_names)


def defined_names(module: Module) -> set[str]:
    """Names ``module`` defines: functions, classes, assigned names, its own ``self.x``/``cls.x`` attributes."""
    names: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return names


def _module_aliases(module: Module, modules: dict[str, Module]) -> set[str]:
    """Local names bound to a package module (``import trl_sae.x as m``, ``from trl_sae import x``)."""
    aliases: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.asname and a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            aliases.update(a.asname or a.name for a in node.names if f"{source}.{a.name}" in modules)
    return aliases


def _own_self(value: ast.expr) -> bool:
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def private_uses(
    module: Module,
    modules: dict[str, Module],
    allowed: dict[str, str],
    defined: dict[str, set[str]] | None = None,
) -> list[str]:
    """``"line: what"`` for each use of another module's (or an unlisted library's) underscore name.

    ``defined``: :func:`defined_names` of every module, by name (computed when not given).
    """
    defined = defined if defined is not None else {name: defined_names(m) for name, m in modules.items()}
    own = defined[module.name]
    elsewhere = {n for name, names in defined.items() if name != module.name for n in names}
    aliases = _module_aliases(module, modules)
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                if _is_private(alias.name) and f"{source}.{alias.name}" not in modules:
                    found.append(f"{node.lineno}: from {source} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and not _own_self(node.value):
            text = f"{node.lineno}: {ast.unparse(node)}"
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                found.append(text + " (another module's private)")
            elif node.attr in own:
                continue
            elif node.attr in elsewhere:
                found.append(text + " (defined by another trl_sae module)")
            elif node.attr not in allowed:
                found.append(text + " (a library's private: use its public API, or list it with a reason)")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def module_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """The modules' import circles: each set of modules that import one another, directly or through others
    (a strongly connected set of two or more), sorted. A package's ``__init__`` is the module of its name."""
    graph = {name: sorted(imported_modules(module, modules) - {name}) for name, module in modules.items()}
    # Tarjan's strongly connected components, iteratively (the package is deeper than a recursion should go).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def layer_violations(modules: dict[str, Module], layers: list[set[str]]) -> list[str]:
    rank = {part: i for i, layer in enumerate(layers) for part in layer}
    found = []
    for module in modules.values():
        for target in sorted(imported_modules(module, modules)):
            target_part = modules[target].part
            if rank.get(target_part, -1) > rank.get(module.part, len(layers)):
                found.append(f"{module.name} imports {target} ({module.part} is below {target_part})")
    return found


def part_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Cycles of the parts' import graph (one per strongly connected set of parts)."""
    graph: dict[str, set[str]] = {}
    for module in modules.values():
        targets = {modules[t].part for t in imported_modules(module, modules)} - {module.part}
        graph.setdefault(module.part, set()).update(targets)
    cycles, seen = [], set()
    for start in sorted(graph):
        path, stack = [start], [iter(sorted(graph[start]))]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                path.pop()
            elif child == start:
                cycle = frozenset(path)
                if cycle not in seen:
                    seen.add(cycle)
                    cycles.append([*path, start])
            elif child not in path and child in graph:
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return cycles


def trainer_part(name: str) -> str | None:
    """The trainer sub-package or top module ``name`` belongs to (None outside ``trl_sae.trainer``)."""
    pieces = name.split(".")
    if pieces[:2] != [PACKAGE, "trainer"]:
        return None
    return pieces[2] if len(pieces) > 2 else "__init__"


def trainer_layer_violations(modules: dict[str, Module], layers: list[set[str]]) -> list[str]:
    rank = {part: i for i, layer in enumerate(layers) for part in layer}
    found = []
    for module in modules.values():
        source = trainer_part(module.name)
        if source is None:
            continue
        for target in sorted(imported_modules(module, modules)):
            target_part = trainer_part(target)
            if target_part is not None and rank.get(target_part, len(layers)) > rank.get(source, -1):
                found.append(
                    f"{module.name} imports {target} (trainer/{source} is below trainer/{target_part})"
                )
    return found


def oversized_modules(modules: dict[str, Module]) -> list[str]:
    found = []
    for module in modules.values():
        limit = MAX_TRAINER_LINES if module.name == f"{PACKAGE}.trainer.sae_ppo_trainer" else MAX_MODULE_LINES
        lines = len(module.path.read_text().splitlines())
        if lines > limit:
            found.append(f"{module.name}: {lines} lines (at most {limit})")
    return found


def modules_without_all(modules: dict[str, Module]) -> list[str]:
    def assigns_all(node: ast.stmt) -> bool:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        return isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in targets
        )

    return [
        name for name, module in modules.items() if not any(assigns_all(node) for node in module.tree.body)
    ]


MODULES = read_package(PACKAGE_ROOT)
DEFINED = {name: defined_names(module) for name, module in MODULES.items()}


# --------------------------------------------------------------------------------------------------
# (a) the trainer's parts do not import the trainer
# --------------------------------------------------------------------------------------------------
TRAINER_PARTS = [
    name
    for name in MODULES
    if name.startswith("trl_sae.trainer.") and name != "trl_sae.trainer.sae_ppo_trainer"
]


@pytest.mark.parametrize("name", TRAINER_PARTS)
def test_a_trainer_part_does_not_import_the_trainer(name):
    assert "trl_sae.trainer.sae_ppo_trainer" not in imported_modules(MODULES[name], MODULES)


# --------------------------------------------------------------------------------------------------
# (b) no module uses another module's underscore names
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_uses_another_modules_private_names(name):
    assert private_uses(MODULES[name], MODULES, THIRD_PARTY_PRIVATES, DEFINED) == []


def test_every_listed_library_private_is_still_used():
    """A private the package stopped using leaves the list, so the list stays the set of real exceptions."""
    used = {
        node.attr
        for module in MODULES.values()
        for node in ast.walk(module.tree)
        if isinstance(node, ast.Attribute) and _is_private(node.attr)
    }
    assert set(THIRD_PARTY_PRIVATES) - used == set()


# --------------------------------------------------------------------------------------------------
# (c) the layering
# --------------------------------------------------------------------------------------------------
def test_every_part_has_a_layer():
    placed = set().union(*LAYERS)
    assert {module.part for module in MODULES.values()} - placed == set()


def test_a_part_imports_only_its_layer_and_the_ones_below():
    assert layer_violations(MODULES, LAYERS) == []


def test_the_parts_import_no_part_in_a_cycle():
    assert part_cycles(MODULES) == []


# --------------------------------------------------------------------------------------------------
# (d) no import circle; the trainer's own layering; (e) module sizes
# --------------------------------------------------------------------------------------------------
def test_no_two_modules_import_each_other_directly_or_around_a_circle():
    assert module_cycles(MODULES) == []


def test_every_trainer_sub_package_has_a_layer():
    placed = set().union(*TRAINER_LAYERS)
    assert {trainer_part(name) for name in MODULES} - {None} - placed == set()


def test_a_trainer_sub_package_imports_only_its_layer_and_the_ones_below():
    assert trainer_layer_violations(MODULES, TRAINER_LAYERS) == []


def test_no_module_is_longer_than_its_limit():
    assert oversized_modules(MODULES) == []


def test_every_module_declares_its_public_names():
    assert modules_without_all(MODULES) == []


def test_core_imports_neither_trl_nor_transformers():
    core = [m for m in MODULES.values() if m.part == "core"]
    assert core and {m.name: third_party_imports(m) & CORE_FORBIDDEN for m in core} == {
        m.name: set() for m in core
    }


# --------------------------------------------------------------------------------------------------
# The checkers find what they look for
# --------------------------------------------------------------------------------------------------
def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    root = tmp_path / PACKAGE
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_package(root)


def test_import_check_finds_a_planted_import_of_the_trainer(tmp_path):
    modules = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "trainer/__init__.py": "",
            "trainer/sae_ppo_trainer.py": "",
            "trainer/part.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from trl_sae.trainer.sae_ppo_trainer import SAEPPOTrainer\n",
            "trainer/other.py": "from . import sae_ppo_trainer\n",
            "trainer/clean.py": "from trl_sae.trainer import part\n",
        },
    )
    importers = {
        name
        for name, m in modules.items()
        if "trl_sae.trainer.sae_ppo_trainer" in imported_modules(m, modules)
    }
    assert importers == {"trl_sae.trainer.part", "trl_sae.trainer.other"}


def test_private_check_finds_planted_private_uses(tmp_path):
    modules = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "_lazy.py": "def exports():\n    pass\n",
            "hub.py": "def _probe():\n    pass\n",
            "trainer/__init__.py": "",
            "trainer/sae_ppo_trainer.py": "class T:\n    def __init__(self):\n        self._stale = True\n"
            "    def _score(self):\n        pass\n",
            "trainer/part.py": (
                "import argparse\n"
                "import trl_sae.hub as hub\n"
                "from trl_sae.hub import _probe\n"  # 1
                "from trl_sae._lazy import exports\n"  # a private module's public name: fine
                "from trl_sae import _lazy\n"  # a private module: fine
                "def run(trainer, parser):\n"
                "    trainer._score()\n"  # 2: defined by sae_ppo_trainer
                "    trainer._stale = False\n"  # 3: another module's attribute, written
                "    hub._probe()\n"  # 4: through the module
                "    parser._actions\n"  # 5: a library's private, unlisted
                "    parser._listed\n"  # listed below: fine
                "    return _lazy, exports\n"
                "class Own:\n"
                "    def __init__(self):\n        self._mine = 1\n"
                "    def __eq__(self, other):\n        return self._mine == other._mine\n"  # its own: fine
            ),
        },
    )
    found = private_uses(modules["trl_sae.trainer.part"], modules, {"_listed": "a test"})
    assert [line.split(":")[0] for line in found] == ["3", "7", "8", "9", "10"]


def test_layer_checks_find_a_planted_upward_import_and_cycle(tmp_path):
    modules = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/math.py": "def f():\n    from trl_sae.trainer.loop import g\n",
            "trainer/__init__.py": "",
            "trainer/loop.py": "from trl_sae.core import math\nimport transformers\ndef g():\n    pass\n",
            "hub.py": "import trl\n",
        },
    )
    assert layer_violations(modules, LAYERS) == [
        "trl_sae.core.math imports trl_sae.trainer.loop (core is below trainer)"
    ]
    assert part_cycles(modules) == [["core", "trainer", "core"]]
    assert module_cycles(modules) == [["trl_sae.core.math", "trl_sae.trainer.loop"]]
    assert third_party_imports(modules["trl_sae.trainer.loop"]) & CORE_FORBIDDEN == {"transformers"}


def test_cycle_layer_and_size_checks_find_planted_ones(tmp_path):
    modules = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from trl_sae import b\n",  # inside a function: still an import
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trl_sae.c import x\n",
            "c.py": "import trl_sae.a\n",
            "d.py": "import trl_sae.a\n",  # imports into the circle, not part of it
            "trainer/__init__.py": "",
            "trainer/config/__init__.py": "from trl_sae.trainer.parts.update import PPOUpdate\n",
            "trainer/parts/__init__.py": "",
            "trainer/parts/update.py": "from trl_sae.trainer.config import SAEPPOConfig\n" + "x = 1\n" * 701,
        },
    )
    assert module_cycles(modules) == [
        ["trl_sae.a", "trl_sae.b", "trl_sae.c"],
        ["trl_sae.trainer.config", "trl_sae.trainer.parts.update"],
    ]
    assert trainer_layer_violations(modules, TRAINER_LAYERS) == [
        "trl_sae.trainer.config imports trl_sae.trainer.parts.update (trainer/config is below trainer/parts)"
    ]
    assert oversized_modules(modules) == ["trl_sae.trainer.parts.update: 702 lines (at most 700)"]
    # Only c.py and d.py name their public names (one plain, one annotated); inside a function does not count.
    named = {
        "c.py": "__all__ = []\n",
        "d.py": "__all__: list[str] = ['x']\n",
        "a.py": "def f():\n    __all__ = []\n",
    }
    for relative, line in named.items():
        path = tmp_path / PACKAGE / relative
        path.write_text(path.read_text() + line)
    assert sorted(modules_without_all(read_package(tmp_path / PACKAGE))) == [
        "trl_sae",
        "trl_sae.a",
        "trl_sae.b",
        "trl_sae.trainer",
        "trl_sae.trainer.config",
        "trl_sae.trainer.parts",
        "trl_sae.trainer.parts.update",
    ]
