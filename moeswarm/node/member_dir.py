"""The directory a joined member keeps its manifest, slice and pieces in: held by that member alone.

`moeswarm join` holds an exclusive lock (slices/locks.py) on DIR/.member.lock for as long as it
runs. With `--dir`, a directory another running member holds is refused in one line. Without it,
the member takes the first of `member-0`, `member-1`, ... under the cache directory
(discovery/invite_model.py `cache_dir`) that no running member holds: several members started at
once on one machine each get their own, and a member started again once it ended gets its old
directory back, with the slice it fetched (a rejoin reuses it).
"""

from __future__ import annotations

from pathlib import Path

from moeswarm.discovery.invite_model import make_dir
from moeswarm.errors import MoeSwarmError
from moeswarm.slices.locks import try_hold

LOCK_NAME = ".member.lock"
MAX_MEMBERS = 256  # member directories tried under the cache directory
_HELD: list[int] = []  # the locks' descriptors: held until this process ends


def claim_member_dir(given: str | Path | None, root: Path) -> Path:
    """The directory this member uses: `given` (`--dir`), or the first free `root/member-N`;
    created when absent, and locked for this process. MoeSwarmError (one line) when `given` is
    another running member's, or cannot be made."""
    if given is not None:
        directory = make_dir(Path(given))
        if not _hold(directory):
            raise MoeSwarmError(f"--dir {directory} is in use by another running member: give each member its own "
                                "--dir (or none: each takes a free directory of its own)")
        return directory
    for number in range(MAX_MEMBERS):
        directory = make_dir(root / f"member-{number}")
        if _hold(directory):
            return directory
    raise MoeSwarmError(f"{MAX_MEMBERS} members already run from {root}: give --dir")


def _hold(directory: Path) -> bool:
    fd = try_hold(directory / LOCK_NAME)
    if fd is None:
        return False
    _HELD.append(fd)
    return True

