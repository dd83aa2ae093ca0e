"""Pieces a member keeps beside its slice (`fetch_slice(..., keep_pieces=True)`), and their reuse.

A member that seeds keeps the checked pieces of its slice in OUT.pieces (a sparse file as long as
the model) with their list in OUT.pieces.done, headed by the manifest's hash. Its seed serves them
(node/member_seed.py); and when it moves to another share (node/rebalancing.py), the pieces the two
shares have in common are copied from there instead of fetched again (`copy_kept`): a move fetches
only the experts it did not hold. A copied piece is checked against the manifest like a fetched
one: a kept file changed on disk costs a fetch, never a wrong byte.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from moeswarm.slices.manifest import Manifest, Piece

RECORD_HEADER = "moeswarm-fetch/1"
_RECORD_LINE = re.compile(r"[0-9]{1,20} [0-9]{1,20}")


def record_header(manifest: Manifest) -> str:
    """The first line of a list of pieces (fetched or kept): which file's pieces they are."""
    return f"{RECORD_HEADER} {manifest.sha256} {manifest.file_size}"


def record_lines(lines: Iterable[str]) -> set[tuple[int, int]]:
    """(offset, length) of each line as the fetcher writes them; anything else (torn, edited) is left out."""
    return {tuple(int(x) for x in line.split()) for line in lines if _RECORD_LINE.fullmatch(line)}


def pieces_paths(out: str | Path) -> tuple[Path, Path]:
    """(the kept pieces' sparse file, the list of the (offset, length) it holds) beside slice `out`."""
    out = Path(out)
    return out.with_name(out.name + ".pieces"), out.with_name(out.name + ".pieces.done")


def kept_pieces(out: str | Path, manifest: Manifest) -> frozenset[tuple[int, int]]:
    """The pieces kept beside slice `out` (`keep_pieces`) for `manifest` (its hash heads the list):
    the ranges a seed of this member may serve; empty when none are kept. They were checked when
    fetched; a fetcher checks each again."""
    kept, listed = pieces_paths(out)
    if not kept.is_file() or not listed.is_file() or kept.stat().st_size != manifest.file_size:
        return frozenset()
    lines = listed.read_text(errors="replace").splitlines()
    if not lines or lines[0] != record_header(manifest):
        return frozenset()
    return frozenset(record_lines(lines[1:]))


def copy_kept(slices: Sequence[str | Path], manifest: Manifest, wanted: Sequence[Piece],
              write: Callable[[Piece, bytes], None]) -> int:
    """Hand `write` each of `wanted` that a slice of `slices` keeps (`kept_pieces`) and whose bytes
    there still match the manifest's hash; returns the bytes handed. Unreadable kept files are
    skipped (their pieces are fetched instead)."""
    copied, left = 0, {(p.offset, p.length): p for p in wanted}
    for out in slices:
        held = kept_pieces(out, manifest) & set(left)
        if not held:
            continue
        try:
            fd = os.open(pieces_paths(out)[0], os.O_RDONLY)
        except OSError:
            continue
        try:
            for key in sorted(held):
                data = os.pread(fd, key[1], key[0])
                if len(data) == key[1] and hashlib.sha256(data).hexdigest() == left[key].sha256:
                    write(left.pop(key), data)
                    copied += key[1]
        except OSError:
            pass
        finally:
            os.close(fd)
    return copied
