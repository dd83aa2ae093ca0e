"""Locks on fetched files' directories, so that processes on one machine never fetch into the same files.

A fetch writes a partial file and its list of pieces beside its output (slices/fetch.py); two
processes fetching the same slice into one directory at once would write, rename and remove each
other's files (docs/network.md, A member's directory). The locks are `fcntl.flock` locks on a
file in the directory: the kernel drops them when their process ends, however it ends, so a lock
is never left behind by a killed process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from moeswarm.errors import MoeSwarmError


def try_hold(lock: str | Path) -> int | None:
    """An open descriptor holding an exclusive lock on `lock` (created when absent), or None when
    another process holds it. The lock lasts until the descriptor is closed or the process ends."""
    fd = _open(lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def held(lock: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock` (created when absent) while the block runs, waiting for
    another process that holds it to finish."""
    fd = _open(lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _open(lock: str | Path) -> int:
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise MoeSwarmError(f"cannot open {lock}: {error.strerror or error}") from None
