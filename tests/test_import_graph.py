"""The core's import graph: the torch bridge's modules import one way.

The graph is built from the source (``ast``), not by importing it: every ``import`` and
``from ... import`` counts, including those inside functions (an import deferred to a
function to dodge a cycle is still part of the cycle); imports under ``if TYPE_CHECKING:``
do not (they never run). The implicit import of a package's ``__init__`` by its submodules
is not an edge, so a package that re-exports its modules is not a cycle by itself.

``python tests/test_import_graph.py`` prints every cycle of ``core/src``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

CORE_SRC = Path(__file__).resolve().parent.parent / "core" / "src"
ROOTS = ("tdist", "tdist_autoload")

#: The torch bridge and the modules on either side of it: none of them may be in a cycle.
BRIDGE = ("tdist._init", "tdist._shrink", "tdist._bridge", "tdist._torch", "tdist_autoload")


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(src: Path = CORE_SRC, roots: tuple[str, ...] = ROOTS) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in roots:
        for path in sorted((src / root).rglob("*.py")):
            found[_module_name(path, src)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` that can run (anywhere but under TYPE_CHECKING)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> Optional[str]:
    """The absolute module name ``node`` imports from."""
    if node.level == 0:
        return node.module
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        package = package[: len(package) - (node.level - 1)]
    base = ".".join(package)
    return f"{base}.{node.module}" if node.module else base


def _known(name: str, modules: dict[str, Path]) -> Optional[str]:
    """``name`` or its nearest enclosing module that is one of ``modules``."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(src: Path = CORE_SRC, roots: tuple[str, ...] = ROOTS) -> dict[str, set[str]]:
    """Module -> the modules of ``src`` (the packages ``roots``; the core's by default) it imports."""
    modules = _modules(src, roots)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, is_package, node)
                if base is None:
                    continue
                for alias in node.names:  # `from pkg import module` imports pkg.module
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                known = _known(target, modules)
                if known is not None and known != name:
                    graph[name].add(known)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles as strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """One shortest cycle through ``start`` inside the component ``within`` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & within):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    return []


def _in_bridge(module: str) -> bool:
    return any(module == b or module.startswith(b + ".") for b in BRIDGE)


def test_graph_sees_the_bridge() -> None:
    """The graph finds the bridge's modules and its one-way edges (the cycle test would pass
    vacuously on an empty graph)."""
    graph = import_graph()
    assert "tdist._torch" in graph["tdist_autoload"]  # torch's creator loads the bridge on first use
    assert "tdist._init" in graph["tdist._torch.registry"]
    assert "tdist._init" in graph["tdist._torch.mirror"]
    assert "tdist._bridge" in graph["tdist._init"]  # the core reports to the observer the bridge installs


def test_the_core_reports_to_the_bridge_without_importing_it() -> None:
    """``_init`` and ``_shrink`` reach the bridge through :mod:`tdist._bridge` only, and no
    module of tdist imports ``tdist_autoload`` (torch's entry point, the top): what they
    share is ``tdist_autoload._shared``, which imports neither side."""
    graph = import_graph()
    for module in ("tdist._init", "tdist._shrink", "tdist._bridge"):
        assert not {m for m in graph[module] if m.startswith("tdist._torch")}, (module, graph[module])
    importers = sorted(m for m, targets in graph.items() if "tdist_autoload" in targets)
    assert not importers, f"{importers} import tdist_autoload; import tdist_autoload._shared instead"
    assert graph["tdist_autoload._shared"] == set()


def test_no_cycle_through_the_torch_bridge() -> None:
    """``_init`` -> ``_torch`` -> ``mirror`` -> ``_init`` and ``tdist_autoload`` <->
    ``_torch.registry`` are gone, and no cycle joins any of these modules again."""
    graph = import_graph()
    for cycle in strongly_connected(graph):
        bridged = [m for m in cycle if _in_bridge(m)]
        assert not bridged, f"import cycle through {bridged}: " + " -> ".join(
            shortest_cycle(graph, bridged[0], set(cycle))
        )


#: Every first-party distribution's source: the core's and each plugin's.
SOURCES = [(CORE_SRC, ROOTS)] + [
    (src, tuple(sorted(p.name for p in src.iterdir() if (p / "__init__.py").exists())))
    for src in sorted((CORE_SRC.parent.parent / "plugins").glob("*/src"))
]


@pytest.mark.parametrize("src, roots", SOURCES, ids=[src.parent.name for src, _ in SOURCES])
def test_no_import_cycle(src: Path, roots: tuple[str, ...]) -> None:
    """No module of the core or of a first-party plugin takes part in an import cycle, not
    even through an import deferred to a function (the core's ``_work`` <-> ``_futures``,
    ``bench`` <-> ``bench.torchft``, ``scenarios`` <-> ``scenarios_ft``, tcp's ``backend`` <->
    ``factory`` and debug's ``hooks`` <-> ``recorder`` were the last)."""
    assert roots, f"{src} has no package"
    graph = import_graph(src, roots)
    cycles = [" -> ".join(shortest_cycle(graph, c[0], set(c))) for c in strongly_connected(graph)]
    assert not cycles, f"import cycles: {cycles}"


def test_autoload_imports_no_tdist_module_at_import() -> None:
    """``tdist_autoload`` runs inside ``import torch``: its module level imports nothing of tdist."""
    path = _modules()["tdist_autoload"]
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("tdist"), ast.unparse(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("tdist") for a in node.names), ast.unparse(node)


if __name__ == "__main__":
    graph = import_graph()
    for component in strongly_connected(graph):
        print(f"cycle of {len(component)} modules: {', '.join(component)}")
        for module in component:
            print("   ", " -> ".join(shortest_cycle(graph, module, set(component))))
