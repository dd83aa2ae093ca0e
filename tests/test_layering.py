"""The package's rooms (its first-level folders and top-level modules) layer.

Every import counts: top-level, inside functions and under ``if TYPE_CHECKING``.
A room may import rooms below it only; two rooms importing each other, however
indirectly, is a cycle, and this test names the imports (file -> file) that close it.
The layers themselves are drawn in docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx

PACKAGE = Path(__file__).resolve().parent.parent / "moeswarm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room_of(module: str) -> str:
    """``moeswarm.engine.scheduler`` -> ``engine``; ``moeswarm.gate`` -> ``gate``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``path`` imports, wherever the import stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a import b`` imports module a.b when b is a module, else a.
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != "moeswarm":
                found.add(target)
    return found


def import_graph() -> tuple[networkx.DiGraph, dict[tuple[str, str], list[str]]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(files)
    rooms = networkx.DiGraph()
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in sorted(files.items()):
        if name == "moeswarm":
            continue
        rooms.add_node(room_of(name))
        for target in sorted(imported_modules(path, modules)):
            edge = (room_of(name), room_of(target))
            if edge[0] != edge[1]:
                rooms.add_edge(*edge)
                edges.setdefault(edge, []).append(
                    f"{files[name].relative_to(PACKAGE.parent)} -> {files[target].relative_to(PACKAGE.parent)}"
                )
    return rooms, edges


def test_no_cycle_between_rooms():
    rooms, edges = import_graph()
    cycles = [sorted(c) for c in networkx.strongly_connected_components(rooms) if len(c) > 1]
    lines = []
    for component in cycles:
        lines.append("rooms in one cycle: " + ", ".join(component))
        for edge in sorted(rooms.subgraph(component).edges):
            lines += ["  " + imported for imported in edges[edge]]
    assert not cycles, "\n".join(lines)


def test_the_library_never_imports_the_tools():
    _, edges = import_graph()
    imports = [line for (source, target), lines in edges.items() if target == "tools" for line in lines]
    assert not imports, "\n".join(imports)
