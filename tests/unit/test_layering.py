"""The package's dependency direction (docs/design.md), read from the source of every module:

    config -> data / rewards / algorithms / batch -> models / plan / run_config -> engines -> weight_sync
           -> controller -> trainer

no module imports one of a later layer (lazy imports inside functions included), no two modules import each
other through any chain, and only the controller imports Ray.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"
LAYER = {"config": 0, "batch": 1, "data": 1, "rewards": 1, "algorithms": 1, "agents": 1, "models": 2, "plan": 2,
         "run_config": 2, "engines": 3, "weight_sync": 4, "controller": 5, "trainer": 6}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file; ``from pkg import submodule`` names the
    submodule only (the package's own contents are not used)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(node.module)
    return names


EDGES = {name: {target for target in imports_of(path) if target in MODULES and target != name}
         for name, path in MODULES.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def test_no_module_imports_a_later_layer():
    upward = [f"{source} -> {target}" for source, targets in EDGES.items() for target in targets
              if layer(source) is not None and layer(target) is not None and layer(target) > layer(source)]
    assert upward == []


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
