"""Apply MOVES.md's module moves to a file tree: `python rewrite_imports.py PATH...`.

Rewrites, in place: dotted module paths (`moeswarm.serve.engine[.Name]`, in code and in strings such
as monkeypatch targets and `-m` arguments), `from moeswarm.PKG import MODULE` where MODULE moved,
and file paths (`moeswarm/serve/engine.py`, or `serve/engine.py` standing alone). In files other
than .py, package-relative dotted paths (`serve.engine`) are rewritten too.
Idempotent: running it twice changes nothing more.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".c", ".h", ".html", ".sh"}


def read_moves() -> dict[str, str]:
    moves = {}
    for line in (HERE / "MOVES.md").read_text().splitlines():
        match = re.fullmatch(r"(moeswarm[\w.]*) -> (moeswarm[\w.]*)", line.strip())
        if match:
            moves[match[1]] = match[2]
    return moves


MOVES = read_moves()
# Longest first: a moved module's dotted path never stops at a shorter one's.
ORDER = sorted(MOVES, key=len, reverse=True)


def dotted(text: str) -> str:
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(old) for old in ORDER) + r")(?!\w)")
    return pattern.sub(lambda m: MOVES[m[1]], text)


def from_import(text: str) -> str:
    """`from moeswarm.generation import latent, ragged` -> `from moeswarm.forward import latent, packed as ragged`."""

    def one(match: re.Match) -> str:
        package, names = match[1], match[2]
        parts = [name.strip() for name in names.split(",")]
        targets = []
        for part in parts:
            name, _, alias = part.partition(" as ")
            old = f"{package}.{name.strip()}"
            new = MOVES.get(old, old)
            new_package, _, new_name = new.rpartition(".")
            targets.append((new_package, new_name, alias.strip() or (name.strip() if new_name != name.strip() else "")))
        if len({package for package, _, _ in targets}) != 1 or all(
                f"{package}.{part.partition(' as ')[0].strip()}" not in MOVES for part in parts):
            return match[0]
        new_package = targets[0][0]
        joined = ", ".join(f"{name} as {alias}" if alias and alias != name else name for _, name, alias in targets)
        return f"from {new_package} import {joined}"

    return re.sub(r"from (moeswarm(?:\.\w+)*) import ([\w ,]+?)(?=\s*(?:#|$))", one, text, flags=re.M)


def paths(text: str) -> str:
    table = {}
    for old, new in MOVES.items():
        old_path, new_path = old.replace(".", "/") + ".py", new.replace(".", "/") + ".py"
        table[old_path] = new_path
        table[old_path.removeprefix("moeswarm/")] = new_path.removeprefix("moeswarm/")
    order = sorted(table, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w/.-])(" + "|".join(re.escape(old) for old in order) + r")(?![\w/])")
    return pattern.sub(lambda m: table[m[1]], text)


def relative_dotted(text: str) -> str:
    table = {old.removeprefix("moeswarm."): new.removeprefix("moeswarm.") for old, new in MOVES.items() if old.count(".") >= 2}
    order = sorted(table, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(old) for old in order) + r")(?![\w/]|\.py)")
    return pattern.sub(lambda m: table[m[1]], text)


def rewrite(text: str, suffix: str) -> str:
    text = from_import(text)
    text = dotted(text)
    text = paths(text)
    if suffix != ".py":
        text = relative_dotted(text)
    return text


def main(roots: list[str]) -> int:
    changed = 0
    for root in map(Path, roots):
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix not in SUFFIXES or ".git" in path.parts or path.name in {"MOVES.md", "rewrite_imports.py"}:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            new = rewrite(text, path.suffix)
            if new != text:
                path.write_text(new)
                changed += 1
                print(path)
    print(f"{changed} files rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["."]))
