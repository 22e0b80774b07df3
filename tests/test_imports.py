"""attnscale's import graph has no cycle, between modules nor between packages: walked from the
sources, lazy (in-function) imports too.

Floors only look down: a package-level cycle (``kernels`` -> ``stats`` -> ``kernels``) is one even
when no two modules import each other, so the check is made at every level of the package tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attnscale

ROOT = Path(attnscale.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imported(name: str, tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that module ``name`` imports, with the packages whose __init__
    Python runs on the way (except ``name``'s own ancestors, which are already running)."""
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    if _is_package(name, modules) and "pkgutil.iter_modules" in modules[name].read_text():
        # A package that imports every module of its folder (attnscale.mechanisms).
        targets.update(m for m in modules if m.rpartition(".")[0] == name)
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                edges.add(prefix)
    return edges


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, ast.parse(path.read_text(encoding="utf-8")), modules)
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _package_graphs(graph: dict[str, set[str]],
                    allowed: frozenset[tuple[str, str]] = frozenset(),
                    ) -> dict[str, dict[str, set[str]]]:
    """For every package P, the graph of its direct children (modules and subpackages): child A
    -> child B when any module in A (or below it) imports any module in B (or below it).
    ``allowed`` edges (importing module, imported child) are left out."""
    modules = _modules()
    out: dict[str, dict[str, set[str]]] = {}
    for package in (m for m in modules if _is_package(m, modules)):
        depth = len(package.split(".")) + 1

        def child(module: str) -> str | None:
            if not module.startswith(package + "."):
                return None
            return ".".join(module.split(".")[:depth])

        children: dict[str, set[str]] = {}
        for name, targets in graph.items():
            if (a := child(name)) is None:
                continue
            children.setdefault(a, set())
            for target in targets:
                b = child(target)
                if b is not None and b != a and (name, b) not in allowed:
                    children[a].add(b)
                    children.setdefault(b, set())
        out[package] = children
    return out


def test_the_import_graph_is_acyclic():
    graph = _graph()
    assert "attnscale.attention" in graph and "attnscale.mechanisms.base" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_imports_back_into_a_package_that_imports_it():
    graphs = _package_graphs(_graph())
    assert "attnscale.kernels" in graphs["attnscale"] and "attnscale.stats" in graphs["attnscale"]
    cycles = {package: cycle for package, children in graphs.items()
              if (cycle := _cycle(children)) is not None}
    assert not cycles, "package-level import cycle: " + "; ".join(
        " -> ".join(c) for c in cycles.values())


def test_the_package_check_finds_a_cycle_no_module_pair_shows():
    # stats -> kernels.native is a real edge; an added kernels.flex -> stats closes a package
    # cycle kernels -> stats -> kernels although no two modules import each other.
    graph = _graph()
    assert "attnscale.kernels.native" in graph["attnscale.stats"]
    graph["attnscale.kernels.flex"] = graph["attnscale.kernels.flex"] | {"attnscale.stats"}
    assert _cycle(graph) is None
    cycle = _cycle(_package_graphs(graph)["attnscale"])
    assert cycle is not None and {"attnscale.kernels", "attnscale.stats"} <= set(cycle)
    # ... and an allowed edge is left out of it.
    allowed = frozenset({("attnscale.kernels.flex", "attnscale.stats")})
    assert _cycle(_package_graphs(graph, allowed)["attnscale"]) is None


def test_the_cycle_finder_finds_a_cycle():
    # The walker must be able to fail: attention -> mechanisms -> base -> attention.
    graph = _graph()
    graph["attnscale.mechanisms.base"] = graph["attnscale.mechanisms.base"] | {"attnscale.attention"}
    assert _cycle(graph) is not None


def test_mechanisms_reach_the_pipeline_without_attention():
    graph = _graph()
    assert "attnscale.pipeline" in graph["attnscale.mechanisms.base"]
    assert "attnscale.attention" not in graph["attnscale.mechanisms.base"]


def _private_imports(name: str, tree: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The ``_names`` module ``name`` takes from other modules of the package: ``from m import
    _x``, and ``m._x`` where ``m`` is a package module it imported."""
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnscale"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and bound[node.value.id] != name
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{bound[node.value.id]}.{node.attr}")
    return found


# Packages whose modules take no private name from another module of attnscale (a helper two
# modules need moves down under a public name).
PRIVATE_CLEAN = ("attnscale.kernels",)


def test_kernel_modules_import_no_private_name():
    modules = _modules()
    bad = {name: found for name, path in modules.items()
           if name.startswith(PRIVATE_CLEAN)
           and (found := _private_imports(name, ast.parse(path.read_text(encoding="utf-8")),
                                          modules))}
    assert not bad, bad


def test_the_private_import_check_finds_one():
    modules = _modules()
    tree = ast.parse("from attnscale.kernels.softcap import _fused_softcap\n"
                     "from attnscale.kernels import native\nnative._rows\n")
    assert _private_imports("attnscale.kernels.entropy", tree, modules) == [
        "from attnscale.kernels.softcap import _fused_softcap", "attnscale.kernels.native._rows"]
