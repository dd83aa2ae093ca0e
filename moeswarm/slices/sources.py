"""Where a joiner fetches its pieces from: the invite's seeder and the seeds announced on the DHT.

Pure functions over plain data. A `Source` is a seeder's address and the pieces it holds (None:
every piece of the file: the inviter's). `fetch_sources` orders them for one joiner: the seeds
that joined members announce first (discovery/seed_record.py), in an order drawn from the
joiner's own bytes so that joiners arriving together spread over them, then the invite's seeder,
which holds everything. slices/fetch.py asks each source in turn for the pieces still missing
that it holds, and passes over a source that fails or lies (every piece is checked against the
manifest's hash).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from moeswarm.slices.manifest import Manifest

PieceKey = tuple[int, int]  # (offset, length) of a piece in the model file


@dataclass(frozen=True)
class Source:
    """A seeder at `address` (HOST:PORT) holding `pieces` (None: every piece)."""

    address: str
    pieces: frozenset[PieceKey] | None = None

    def holds(self, key: PieceKey) -> bool:
        return self.pieces is None or key in self.pieces


def fetch_sources(invite_seed: str, seeds: Iterable, manifest: Manifest, tls: bool, own: str | None,
                  order_seed: bytes) -> list[Source]:
    """The sources of a joiner's pieces, in the order to ask them (see the module's docstring).

    seeds: SeedRecords read from the DHT; only those of `manifest` (its sha256), whose TLS is
    `tls`, and not at `own` (this member's own seed address) count; each holds the pieces of a
    slice of its `experts` (of its `layers`, with the trunk when `trunk`: a stage member's)."""
    from moeswarm.slices.manifest import ManifestError

    chosen, experts = [], set(manifest.data["expert_ids"])
    for record in seeds:
        if record.manifest != manifest.sha256 or record.tls != tls or record.address in (own, invite_seed):
            continue
        if not set(record.experts) <= experts:
            continue  # not experts of this model: nothing it claims can be asked for
        try:
            pieces = frozenset((p.offset, p.length) for p in manifest.pieces(record.experts, record.layers, record.trunk))
        except ManifestError:
            continue  # layers without a MoE layer of this model: it claims nothing that can be asked for
        chosen.append(Source(record.address, pieces))
    chosen.sort(key=lambda source: hashlib.sha256(order_seed + source.address.encode()).digest())
    return chosen + [Source(invite_seed)]
