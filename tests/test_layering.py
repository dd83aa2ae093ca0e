"""The package's rooms (its first-level folders and top-level modules) layer.

Every import counts: top-level, inside functions and under ``if TYPE_CHECKING``.
A room may import rooms below it only; two rooms importing each other, however
indirectly, is a cycle, and this test names the imports (file -> file) that close it.
The layers themselves are drawn in docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
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


# The benchmarks and the WAN emulator are the moeswarm-bench distribution (bench/), outside the library.
# The library names it in one place only: cli.py loads `moeswarm bench` and `moeswarm wan` from it by name.
TOOLS = "moeswarm_bench"
TOOLS_HOOK = "moeswarm/cli.py"


def names_the_tools(path: Path) -> list[str]:
    """Where ``path`` imports the tools' package or names it for an import by name (a string such as
    ``"moeswarm_bench.commands"``): ``file:line`` each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            targets = [node.value]
        else:
            continue
        if any(re.match(rf"{TOOLS}(\.\w+)*$", target) for target in targets):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_the_library_never_imports_the_tools():
    places = [place for path in sorted(PACKAGE.rglob("*.py")) for place in names_the_tools(path)]
    assert not [place for place in places if not place.startswith(TOOLS_HOOK + ":")], "\n".join(places)
    assert places, f"the hook ({TOOLS_HOOK}) no longer names {TOOLS}: move this test's hook with it"


def test_the_tools_are_no_room_of_the_library():
    assert not (PACKAGE / "tools").exists()
    assert not list(PACKAGE.rglob("moeswarm_bench"))
