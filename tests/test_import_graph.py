"""The project's import graph: no cycles, and the layers import downwards only.

    memvit.memory_core  <-  memvit.adapters  <-  memvit.server

Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING`` (a cycle
through a type-only import is still two modules that need each other). Run as a script
(``python -m tests.test_import_graph``) to print the graph's cycles and its layer violations.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("memory_core", "adapters", "server")  # the folders; installed as memvit.<folder>
# What each layer must never import (its own layer and the ones below it are fine).
FORBIDDEN = {
    "memvit.memory_core": ("memvit.adapters", "memvit.server", "fastapi"),
    "memvit.adapters": ("memvit.server",),
}
# Inside a package, its subpackages (and top-level modules) in layer order, lowest first: a module
# may import its own layer and those listed before it, never one listed after. A name not listed
# is unconstrained (the package's own __init__, say). Each package's __init__ says the same in words.
SERVER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "settings", "telemetry", "demo"),
    ("store",),
    ("registry",),
    ("tenancy",),
    ("inference",),
    ("edge", "oip"),
    ("http", "routers"),
    ("frontend", "ray"),
    ("cli", "ray_serve", "ray_router", "ray_proxy"),
)
MEMORY_CORE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "runtime"),
    ("weights", "block"),
    ("sets",),
    ("output",),
    ("routing",),
    ("invariant", "stored"),
    ("engine",),
    ("oracle",),
)
ADAPTERS_LAYERS: tuple[tuple[str, ...], ...] = (("files", "preprocess"), ("bundle",), ("training",))
SUBLAYERS = {
    "memvit.server": SERVER_LAYERS,
    "memvit.memory_core": MEMORY_CORE_LAYERS,
    "memvit.adapters": ADAPTERS_LAYERS,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(["memvit", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _layer(module: str) -> str:
    """``memvit.server.cli`` -> ``memvit.server``; ``fastapi.routing`` -> ``fastapi``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "memvit" else parts[0]


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports, absolute; ``from package import module`` names the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in known else target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each project module -> every module it imports (the project's and others')."""
    modules = _modules()
    return {name: imports(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one project module (Tarjan's, iterative)."""
    project = {name: sorted(t for t in ts if t in graph and t != name) for name, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in project:
        if root in index:
            continue
        work = [(root, iter(project[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(project[child])))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while (member := stack.pop()) != node:
                    component.append(member)
                if component:
                    found.append(sorted([*component, node]))
    return found


def violations(graph: dict[str, set[str]]) -> list[str]:
    """``module -> import`` for every import across a forbidden layer boundary."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if _layer(target) in FORBIDDEN.get(_layer(name), ())
    )


def _rank(module: str) -> tuple[str, int] | None:
    """(package, the layer index of ``module``'s first name inside it), or None if not listed."""
    parts = module.split(".")
    package = ".".join(parts[:2])
    if len(parts) < 3 or package not in SUBLAYERS:
        return None
    for index, names in enumerate(SUBLAYERS[package]):
        if parts[2] in names:
            return package, index
    return None


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """``module -> import`` for every import of a higher layer inside one package (``SUBLAYERS``)."""
    found = []
    for name, targets in graph.items():
        mine = _rank(name)
        for target in targets:
            theirs = _rank(target)
            if mine and theirs and mine[0] == theirs[0] and theirs[1] > mine[1]:
                found.append(f"{name} -> {target}")
    return sorted(found)


def old_names(graph: dict[str, set[str]]) -> list[str]:
    """``module -> import`` for every import of a folder by its bare name (``server``, not ``memvit.server``).

    The wheel installs only ``memvit``: a bare ``import server`` works in a checkout (the folder is on
    the path) and fails once installed, or loads a second copy of the module beside memvit's.
    """
    return sorted(f"{n} -> {t}" for n, ts in graph.items() for t in ts if t.split(".")[0] in PACKAGES)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The project's graph, read once for the module (every file parsed: ~0.75 s); the tests only read it."""
    return import_graph()


def test_the_graph_is_read(graph) -> None:
    assert len(graph) > 40 and {
        "memvit.memory_core",
        "memvit.adapters.training.run",
        "memvit.server.cli.train",
    } <= set(graph)
    # Relative, function-level and type-only imports are all edges.
    assert "memvit.adapters.training.checkpoint" in graph["memvit.adapters.training.run"]
    assert "memvit.adapters.training.sweep" in graph["memvit.server.cli.train"]  # imported inside train()
    assert (
        "memvit.server.settings" in graph["memvit.server.cli.serve"]
    )  # under TYPE_CHECKING and inside serve()


def test_no_import_cycles(graph) -> None:
    assert cycles(graph) == []


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c", "os"}, "c": {"a"}, "d": {"d", "a"}, "e": {"f"}, "f": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_layers_import_downwards_only(graph) -> None:
    assert violations(graph) == []


def test_violations_are_found() -> None:
    graph = {
        "memvit.memory_core.x": {"fastapi.routing", "torch"},
        "memvit.adapters.y": {"memvit.server.cli"},
        "memvit.server.z": {"memvit.adapters"},
    }
    assert violations(graph) == [
        "memvit.adapters.y -> memvit.server.cli",
        "memvit.memory_core.x -> fastapi.routing",
    ]


def test_no_upward_arrows_inside_a_package(graph) -> None:
    assert upward_arrows(graph) == []


def test_every_server_name_has_a_layer() -> None:
    """A new module or package in server/ says where it sits (server/__init__.py says it in words)."""
    listed = {name for layer in SERVER_LAYERS for name in layer}
    present = {p.stem for p in (REPO / "server").glob("*.py")} - {"__init__"}
    present |= {p.parent.name for p in (REPO / "server").glob("*/__init__.py")}
    assert present == listed


def test_upward_arrows_are_found(monkeypatch) -> None:
    monkeypatch.setitem(SUBLAYERS, "memvit.server", (("errors",), ("http",), ("cli",)))
    graph = {
        "memvit.server.errors": {"memvit.server.http.send"},
        "memvit.server.http.app": {"memvit.server.errors", "memvit.server.http.deps"},
        "memvit.server.cli.serve": {"memvit.server.http.app", "memvit.server.unlisted"},
    }
    assert upward_arrows(graph) == ["memvit.server.errors -> memvit.server.http.send"]


def test_every_import_names_memvit(graph) -> None:
    assert old_names(graph) == []
    assert old_names({"memvit.server.x": {"server.old", "memvit.adapters", "adapters_hub"}}) == [
        "memvit.server.x -> server.old"
    ]


if __name__ == "__main__":
    graph = import_graph()
    print(f"{len(graph)} modules, {sum(len(t) for t in graph.values())} imports")
    for component in cycles(graph):
        print("cycle:", " <-> ".join(component))
    for line in violations(graph):
        print("layer violation:", line)
    for line in old_names(graph):
        print("bare folder name:", line)
    for line in upward_arrows(graph):
        print("upward arrow:", line)
