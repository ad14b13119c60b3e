"""The package's import graph follows the layers of docs/design/layers.md, read from its
tier table: imports point downward only, and no module imports itself through others
(no cycle). Imports inside functions count: they are ties all the same, only hidden.
Modules named in strings (``python -m ...``, package data) are the doc's second table."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hpctrain"
LAYERS_DOC = REPO / "docs" / "design" / "layers.md"


def _doc_table(heading_cells: tuple[str, ...]) -> list[list[str]]:
    """The rows of the layers doc's table whose header row is ``heading_cells``."""
    rows, inside = [], False
    for line in LAYERS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if tuple(cells) == heading_cells:
            inside = True
        elif inside and line.startswith("|") and not set(line) <= set("|- "):
            rows.append(cells)
        elif inside and not line.startswith("|"):
            break
    return rows


def doc_tiers() -> dict[str, int]:
    """Subpackage or top-level module -> tier, from the doc's tier table (``cli/`` is
    ``cli``, ``errors.py`` is ``errors``); the package's own ``__init__`` is tier 0.
    Lower tiers never import higher ones; packages on one tier do not import each other."""
    tiers = {"": 0}
    for tier, packages, _ in _doc_table(("tier", "packages", "what they know")):
        for name in re.findall(r"`([^`]+)`", packages):
            tiers[name.removesuffix("/").removesuffix(".py")] = int(tier)
    return tiers


TIERS = doc_tiers()


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


MODULE_PATH = re.compile(r"hpctrain(\.[a-z_][a-z0-9_]*)*")


def named_in_strings() -> set[tuple[str, str]]:
    """(module, named module) for every string constant in the package spelled like one
    of its module paths (``hpctrain.jobs.bind``), whether that module exists or not."""
    found = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and MODULE_PATH.fullmatch(node.value) and node.value != name:
                found.add((name, node.value))
    return found


def test_the_tier_table_is_read_from_the_doc():
    assert TIERS["cli"] == 8 and TIERS["model"] == TIERS["comm"] == 1
    assert TIERS["errors"] == 0 and TIERS["__main__"] == 9 and len(TIERS) > 15


def test_modules_named_in_strings_are_the_docs_list():
    declared = {(frm.strip("`"), to.strip("`"))
                for frm, to, _ in _doc_table(("in", "names", "how"))}
    found = named_in_strings()
    assert found - declared == set(), (
        "modules named in strings but missing from docs/design/layers.md's list: "
        f"{sorted(found - declared)}")
    assert declared - found == set(), (
        f"docs/design/layers.md lists strings the code no longer has: {sorted(declared - found)}")
    mods = _modules()
    missing = sorted(to for _, to in found if to not in mods)
    assert not missing, f"strings name modules that do not exist (renamed?): {missing}"
