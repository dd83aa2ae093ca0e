"""A joined member's seed: the pieces it fetched, served to later joiners and announced on the DHT.

`moeswarm join` keeps the pieces of the share it fetched (slices/fetch.py `keep_pieces`: a
sparse file as long as the model, and the list of what it holds). Its seed serves them with the
inviter's protocol (slices/seed.py, limited to those pieces: anything else gets ERR!) and
announces a SeedRecord (discovery/seed_record.py) naming the experts whose slice pieces it holds,
refreshed every TTL/3 and withdrawn on a clean exit, as a worker's record is. A later joiner
fetches from it (slices/sources.py), checking every piece against the manifest: a seed is trusted
for nothing.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeswarm.slices.kept import kept_pieces, pieces_paths
from moeswarm.slices.manifest import Manifest
from moeswarm.slices.seed import Seeder

if TYPE_CHECKING:
    from moeswarm.discovery.announce import Announcer
    from moeswarm.discovery.dht import SwarmDht


class MemberSeed:
    """A seeder of a member's kept pieces and its announcement, started and stopped together."""

    def __init__(self, seeder: Seeder, manifest: Manifest, experts: Sequence[int], dht: SwarmDht,
                 host: str, port: int, announce_host: str | None, ttl_s: float,
                 layers: tuple[int, int] | None = None, trunk: bool = False):
        self.seeder = seeder
        self.manifest = manifest
        self.experts = tuple(experts)
        self.layers, self.trunk = layers, trunk
        self.dht = dht
        self.host, self.port, self.announce_host, self.ttl_s = host, port, announce_host, ttl_s
        self.announcer: Announcer | None = None
        self.address: str | None = None

    async def start(self) -> str:
        """Listen, announce; return the announced HOST:PORT."""
        from moeswarm.discovery.announce import Announcer, announce_address
        from moeswarm.discovery.seed_record import SEEDS, SeedRecord

        _, port = await self.seeder.start(self.host, self.port)
        self.address = announce_address(self.host, port, self.announce_host)
        record = SeedRecord(self.address, self.manifest.fingerprint, self.manifest.sha256, self.experts,
                            self.seeder.tls is not None, layers=self.layers, trunk=self.trunk)
        announcer = Announcer(self.dht, record, self.ttl_s, kind=SEEDS)
        try:
            await asyncio.get_running_loop().run_in_executor(None, announcer.start)
        except BaseException:
            await self.seeder.close()
            raise
        self.announcer = announcer
        return announcer.record.address

    async def stop(self) -> None:
        """Withdraw the announcement, then close the seeder (a fetcher in flight resumes elsewhere)."""
        if self.announcer is not None:
            announcer, self.announcer = self.announcer, None
            await asyncio.get_running_loop().run_in_executor(None, announcer.stop)
        await self.seeder.close()


def open_member_seed(slice_path: str | Path, manifest: Manifest, experts: Sequence[int], tls: ssl.SSLContext | None,
                     dht: SwarmDht, host: str, port: int, announce_host: str | None,
                     ttl_s: float, layers: tuple[int, int] | None = None, trunk: bool = False) -> MemberSeed | None:
    """The seed of the pieces kept beside `slice_path` (the slice of `experts`, of MoE `layers`
    (None: all), with the trunk when `trunk`: a stage member's), or None when they are not all
    there (a slice fetched without keeping them): a seed claims only what it holds whole."""
    held = kept_pieces(slice_path, manifest)
    wanted = {(p.offset, p.length) for p in manifest.pieces(experts, layers, trunk)}
    if not held or not wanted <= held:
        return None
    seeder = Seeder(pieces_paths(slice_path)[0], tls, pieces=frozenset(wanted))
    return MemberSeed(seeder, manifest, experts, dht, host, port, announce_host, ttl_s, layers, trunk)


class ShareSeed:
    """The seed of a member's current share, replaced when its share moves (node/rebalancing.py,
    and a stage member's span: node/stage_seed.py).

    open_seed(share, first): the MemberSeed of that share's kept pieces, or None (not kept);
    `first` is True for the share the member joined with (it may take `--seed-port`). what: the
    share's word in its lines ("share": experts; "span": a stage's layers)."""

    def __init__(self, open_seed: Callable[[Any, bool], MemberSeed | None], report: Callable[[str], None],
                 what: str = "share"):
        self.open_seed = open_seed
        self.report = report
        self.what = what
        self.seed: MemberSeed | None = None
        self._first = True

    async def follow(self, share) -> None:
        """Seed the pieces of `share` (experts, or a span): the new seed started and announced first,
        then the old one withdrawn and closed."""
        new = self.open_seed(share, self._first)
        self._first = False
        if new is None:
            self.report(f"not seeding: the {self.what}'s pieces were not kept beside its slice (fetched with "
                        "--no-seed, or by an older moeswarm)")
        else:
            self.report(f"seeding the {self.what}'s pieces as {await new.start()}")
        old, self.seed = self.seed, new
        if old is not None:
            await old.stop()

    async def stop(self) -> None:
        if self.seed is not None:
            seed, self.seed = self.seed, None
            await seed.stop()
