"""The package's import graph follows the layers of docs/design/layers.md: imports point
downward only, and no module imports itself through others (no cycle). Imports inside
functions count: they are ties all the same, only hidden."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hpctrain"

# Lower tiers never import higher ones; packages on one tier do not import each other.
TIERS = {
    "": 0, "errors": 0, "files": 0, "progress": 0, "profiling": 0, "systems": 0, "recipes": 0,
    "model": 1, "comm": 1,
    "config": 2,
    "data": 3,
    "parallel": 4,
    "checkpoint": 5, "jobs": 5, "doctor": 5,
    "train": 6,
    "scaling": 7,
    "cli": 8, "__main__": 9,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["hpctrain", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_subpackage_has_a_tier():
    missing = {subpackage(m) for m in _modules()} - set(TIERS)
    assert not missing, f"add {sorted(missing)} to TIERS (and to docs/design/layers.md)"


def test_no_upward_or_sideways_import():
    bad = []
    for a, targets in import_graph().items():
        for b in targets:
            pa, pb = subpackage(a), subpackage(b)
            if pa != pb and TIERS[pb] >= TIERS[pa] and TIERS[pb] > 0:
                bad.append(f"{a} -> {b}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_cycle_finder(graph, expected):
    assert cycles(graph) == expected
