"""The pymoe corpus: the running Python's own standard library sources.

Deterministic on any machine with the same Python build:
- files: every ``*.py`` under ``sysconfig.get_paths()['stdlib']``, sorted by relative POSIX path,
  skipping test suites, IDLE, lib2to3, turtledemo, site-packages, pydoc_data (a huge generated
  text blob, not code) and encodings (mostly generated charmap tables: repetitive, would dominate).
- split by file: a file is held out when ``sha256(relpath) % 100 < HELDOUT_PERCENT``. Hashing the
  path (not a random draw) keeps the split stable when files are added or removed.
- documents are joined with the ``<|endoftext|>`` token.
"""
from __future__ import annotations

import hashlib
import pathlib
import sysconfig

EXCLUDE_PARTS = {
    "test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
    "pydoc_data", "encodings", "__pycache__",
}
HELDOUT_PERCENT = 5
EOT = "<|endoftext|>"


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def list_files(root: pathlib.Path | None = None) -> list[str]:
    """Sorted relative paths of the corpus files."""
    root = root or stdlib_root()
    rels = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if any(p in EXCLUDE_PARTS for p in rel.parts):
            continue
        rels.append(rel.as_posix())
    return sorted(rels)


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def split(root: pathlib.Path | None = None) -> tuple[list[str], list[str]]:
    files = list_files(root)
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def read(rel: str, root: pathlib.Path | None = None) -> str:
    root = root or stdlib_root()
    # errors="replace": a few stdlib files carry latin-1 bytes; keep the run deterministic.
    return (root / rel).read_text(encoding="utf-8", errors="replace")
