"""Apply MOVES.md's module moves to a file tree: `python rewrite_imports.py PATH...`.

Rewrites, in place: dotted module paths (`moeswarm.serve.engine[.Name]`, in code and in strings such
as monkeypatch targets and `-m` arguments), `from moeswarm.PKG import MODULE` where MODULE moved,
and file paths (`moeswarm/serve/engine.py`, or `serve/engine.py` standing alone; a moved package's
folder, `moeswarm/tools/bench/`; other files moved, `moeswarm/weights/qkernels.c`). In files other
than .py, package-relative dotted paths (`serve.engine`) are rewritten too.

MOVES.md's lines: `old.module -> new.module`, `old/file.c -> new/file.c`, and `PACKAGE lives at FOLDER`
for a top-level package whose folder is not its name at the repository's root (moeswarm_bench lives in
bench/moeswarm_bench: its files' paths are written from there).
Idempotent: running it twice changes nothing more.

`python rewrite_imports.py --move [REPO]` moves the files themselves first (`git mv`, in the checkout at
REPO, the current folder by default): each module, package and file the table moves, where it still is at
its old place (a module added since to a moved package moves with it; one left in a folder the
table empties is named on stderr). Then rewrite the text: `python rewrite_imports.py moeswarm tests ...`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml", ".c", ".h", ".html", ".sh"}


def read_moves() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(module moves, other files' moves, where top-level packages live)."""
    moves, files, homes = {}, {}, {}
    for line in (HERE / "MOVES.md").read_text().splitlines():
        if match := re.fullmatch(r"(moeswarm[\w.]*) -> (moeswarm[\w.]*)", line.strip()):
            moves[match[1]] = match[2]
        elif match := re.fullmatch(r"(moeswarm/[\w/.]+) -> ([\w/.]+)", line.strip()):
            files[match[1]] = match[2]
        elif match := re.fullmatch(r"(\w+) lives at ([\w/.]+)", line.strip()):
            homes[match[1]] = match[2].rstrip("/")
    return moves, files, homes


MOVES, FILES, HOMES = read_moves()
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

    return re.sub(r"from (moeswarm(?:\.\w+)*) import ([\w ,]+?)(?=\s*(?:#|;|$))", one, text, flags=re.M)


def folder(module: str) -> str:
    """A module's path in the repository, without `.py`: `moeswarm_bench.wan.link` -> `bench/moeswarm_bench/wan/link`."""
    top, _, rest = module.partition(".")
    return HOMES.get(top, top) + ("/" + rest.replace(".", "/") if rest else "")


def short(path: str) -> str:
    """A path as written standing alone: `moeswarm/serve/engine.py` -> `serve/engine.py` (moeswarm's own
    modules are named from inside the package); another package's from its own name, `moeswarm_bench/wan/link.py`."""
    if path.startswith("moeswarm/"):
        return path.removeprefix("moeswarm/")
    for top, home in HOMES.items():
        if path.startswith(home + "/"):
            return top + path.removeprefix(home)
    return path


def paths(text: str) -> str:
    table = {}
    packages = {old for old in MOVES if any(other.startswith(old + ".") for other in MOVES)}
    for old, new in MOVES.items():
        ending = "/" if old in packages else ".py"
        old_path, new_path = folder(old) + ending, folder(new) + ending
        table[old_path] = new_path
        table[short(old_path)] = short(new_path)
    for old, new in FILES.items():
        table[old] = new
        table[short(old)] = short(new)
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


def placements(root: Path) -> dict[Path, Path]:
    """Each file of the tree at `root` still at an old place -> its new place: a moved module's file, a
    moved package's files (those the table does not name one by one too: a module added since), other files."""
    packages = {old: new for old, new in MOVES.items() if any(other.startswith(old + ".") for other in MOVES)}
    places = {root / (folder(old) + ".py"): root / (folder(new) + ".py") for old, new in MOVES.items()}
    places.update({root / old: root / new for old, new in FILES.items()})
    for old, new in sorted(packages.items(), key=lambda item: len(item[0])):
        for path in (root / folder(old)).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                places.setdefault(path, root / folder(new) / path.relative_to(root / folder(old)))
    return {old: new for old, new in places.items() if old.is_file()}


def move(root: Path) -> int:
    """`--move`: `git mv` what is still at an old place; name what is left in a folder that moves emptied."""
    import subprocess

    places = placements(root)
    for old, new in sorted(places.items()):
        new.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(old.relative_to(root)), str(new.relative_to(root))], cwd=root, check=True)
        print(f"{old.relative_to(root)} -> {new.relative_to(root)}")
    emptied = {old.parent for old in places}
    for folder_ in sorted(emptied, key=lambda path: len(path.parts), reverse=True):  # empty ones go
        for cache in folder_.glob("__pycache__"):
            if not any(cache.glob("*.py")):
                subprocess.run(["rm", "-r", str(cache)], check=True)
        if folder_.is_dir() and not any(folder_.iterdir()):
            folder_.rmdir()
    for left in sorted(path for folder_ in emptied if folder_.is_dir() for path in folder_.rglob("*")
                       if path.is_file() and "__pycache__" not in path.parts):
        print(f"left, not in MOVES.md: {left.relative_to(root)}", file=sys.stderr)
    print(f"{len(places)} files moved", file=sys.stderr)
    return 0


def main(roots: list[str]) -> int:
    if roots[:1] == ["--move"]:
        return move(Path(roots[1] if len(roots) > 1 else "."))
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
