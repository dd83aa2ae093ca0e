"""A joiner fetches the owner's manifest from a seeder of the manifest file, pinned by the invite's hash.

The invite (discovery/invite.py) names the manifest's sha256 and length; the bytes come from any
seeder of that file (slices/seed.py serves any file), in pieces of at most MAX_REQUEST bytes over
one connection, and are kept only when the whole file has the pinned hash. A manifest already in
the joiner's directory with that hash is used without asking anyone.
"""

from __future__ import annotations

import hashlib
import os
import ssl
import time
from pathlib import Path

from moeswarm.slices.fetch import Broken, FetchError, ranges
from moeswarm.slices.manifest import Manifest, Piece, load_manifest
from moeswarm.slices.protocol import MAX_REQUEST

RETRIES = 3


def fetch_manifest(peer: str, sha256: str, size: int, out: str | Path, tls: ssl.SSLContext | None = None,
                   timeout_s: float = 30.0) -> Manifest:
    """The manifest of hash `sha256` and `size` bytes, fetched from `peer` (HOST:PORT) into `out`
    unless `out` already holds it; FetchError when the seeder is unreachable or sends another file."""
    out = Path(out)
    if out.is_file() and out.stat().st_size == size and hashlib.sha256(out.read_bytes()).hexdigest() == sha256:
        return load_manifest(out, sha256)
    pieces = [Piece(offset, min(MAX_REQUEST, size - offset), "", f"manifest bytes from {offset}")
              for offset in range(0, size, MAX_REQUEST)]
    for attempt in range(RETRIES + 1):
        try:
            data = b"".join(chunk for _, chunk in ranges(peer, pieces, tls, timeout_s))
            break
        except Broken as error:
            if attempt == RETRIES:
                hint = "" if tls else " (if the swarm is keyed, pass your member file as --swarm-key)"
                raise FetchError(f"manifest seeder {peer}: {error}{hint}") from None
            time.sleep(min(0.5 * 2 ** attempt, 5.0))
    if hashlib.sha256(data).hexdigest() != sha256:
        raise FetchError(f"manifest seeder {peer} sent a file whose sha256 is not the invite's {sha256}: "
                         f"it serves another manifest, or lies")
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")  # its own: processes fetching at once never share one
    partial.write_bytes(data)
    partial.replace(out)
    return load_manifest(out, sha256)
