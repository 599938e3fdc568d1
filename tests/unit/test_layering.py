"""The package's dependency direction (docs/design.md), read from the source of every module:

    config, checkpoint_io.files -> data / rewards / algorithms / batch
           -> models / plan / run_config / checkpoint_io -> engines -> weight_sync -> controller -> trainer

no module imports one of a later layer (lazy imports inside functions included, relative imports resolved,
``importlib.import_module("megarl....")`` and ``__import__`` with a literal name counted), no relative import
climbs out of its package (``from ..x import y``: say the absolute name), every part of the package has a
layer in the table, no two modules import each other through any chain, and only the controller imports Ray.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"
LAYER = {"config": 0, "batch": 1, "data": 1, "rewards": 1, "algorithms": 1, "agents": 1, "models": 2, "plan": 2,
         "doctor": 7,
         "run_config": 2, "checkpoint_io": 2, "engines": 3, "weight_sync": 4, "controller": 5, "trainer": 6,
         # a module whose layer is not its package's: how a whole-or-absent file is written, for the data writers too
         "checkpoint_io.files": 0,
         # the package's own import hook (megarl/__init__.py installs it): imports nothing of megarl
         "_import_guards": 0}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _literal_import(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("...")`` / ``import_module("...")`` / ``__import__("...")``."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_in(source: str, module: str, is_package: bool) -> tuple[set[str], list[str]]:
    """Every module named by an import anywhere in ``source`` (the text of ``module``), and the relative imports
    that climb out of its package. ``from pkg import submodule`` names the submodule only (the package's own
    contents are not used)."""
    names, climbing = set(), []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if node.level > 1:
                    climbing.append(f"{module}:{node.lineno}: from {'.' * node.level}{base} import ...")
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            submodules = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(base)
        elif isinstance(node, ast.Call) and (named := _literal_import(node)):
            names.add(named)
    return names, climbing


SCANNED = {name: imports_in(path.read_text(), name, path.name == "__init__.py") for name, path in MODULES.items()}


def imports_of(path: Path) -> set[str]:
    return SCANNED[module_name(path)][0]


def _edges(names: set[str], module: str) -> set[str]:
    """Imports of megarl modules; an import of a name inside a module (``import megarl.x.func``) is an edge to
    the module that holds it."""
    edges = set()
    for target in names:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != module and target != "megarl":
            edges.add(target)
    return edges


EDGES = {name: _edges(imports_of(path), name) for name, path in MODULES.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    if ".".join(parts[1:3]) in LAYER:
        return LAYER[".".join(parts[1:3])]
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def test_no_module_imports_a_later_layer():
    upward = [f"{source} -> {target}" for source, targets in EDGES.items() for target in targets
              if layer(source) is not None and layer(target) is not None and layer(target) > layer(source)]
    assert upward == []


def test_every_part_of_the_package_has_a_layer():
    parts = {name.split(".")[1] for name in MODULES if name.count(".") >= 1} - {"__main__"}
    assert sorted(parts - LAYER.keys()) == []


def test_no_relative_import_climbs_out_of_its_package():
    climbing = [line for _, lines in SCANNED.values() for line in lines]
    assert climbing == []


def test_no_import_cycles():
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in EDGES[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in EDGES:
        if node not in index:
            visit(node)
    assert cycles == []


def test_only_the_controller_imports_ray():
    importers = sorted(name for name, path in MODULES.items()
                       if any(target == "ray" or target.startswith("ray.") for target in imports_of(path))
                       and not name.startswith("megarl.controller"))
    assert importers == []


def test_the_checks_see_what_they_check():
    # a known downward edge and a known lazy import are both found
    assert "megarl.engines.megatron.parallel" in EDGES["megarl.controller.megatron_role"]
    assert "megarl.engines.rollout.vllm_engine" in EDGES["megarl.engines.rollout.factory"]
    assert "ray" in imports_of(MODULES["megarl.controller.roles"])
    # planted: an upward relative import, one that climbs, and importlib / __import__ with a literal name
    planted = ("from .loop import Trainer\nfrom ..trainer import loop\n"
               "import importlib\nimportlib.import_module('megarl.controller.roles')\n__import__('megarl.weight_sync')\n"
               "def f(name):\n    return importlib.import_module(name)\n")
    names, climbing = imports_in(planted, "megarl.trainer.fake", is_package=False)
    assert _edges(names, "megarl.models.fake") == {"megarl.trainer.loop", "megarl.controller.roles", "megarl.weight_sync"}
    assert climbing == ["megarl.trainer.fake:2: from ..trainer import ..."]
    names, _ = imports_in("from . import bridge\nfrom .bridge import ModelBridge\n", "megarl.models", is_package=True)
    assert names == {"megarl.models.bridge"}
