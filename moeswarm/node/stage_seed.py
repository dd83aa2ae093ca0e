"""A stages swarm member's seed: its span's kept pieces served to later joiners, following its span.

The seed is node/member_seed.py's (the inviter's protocol, limited to the pieces kept; a
SeedRecord naming every expert of the span's MoE layers and the trunk: discovery/seed_record.py).
A stage member runs on threads, the seed on asyncio: `SpanSeed` runs it on an event loop of its
own thread and waits for each start and stop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeswarm.node.member_seed import MemberSeed


class SpanSeed:
    """The seed of a stage member's current span, replaced when the span moves (node/stage_member.py).

    open_seed(span, first): the MemberSeed of that span's kept pieces, or None (not kept); `first`
    is True for the span the member joined with (it may take `--seed-port`)."""

    def __init__(self, open_seed: Callable[[range, bool], MemberSeed | None], report: Callable[[str], None]):
        self.open_seed = open_seed
        self.report = report
        self.seed: MemberSeed | None = None
        self._first = True
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="moeswarm-stage-seed", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str | None:
        """The seed's announced HOST:PORT (None: not seeding)."""
        return self.seed.address if self.seed is not None else None

    def follow(self, span: range) -> None:
        """Seed the pieces of `span`'s slice: the new seed started and announced first, then the old
        one withdrawn and closed."""
        new = self.open_seed(span, self._first)
        self._first = False
        if new is None:
            self.report("not seeding: the span's pieces were not kept beside its slice (fetched with --no-seed, "
                        "or by an older moeswarm)")
        else:
            self.report(f"seeding the span's pieces as {self._run(new.start())}")
        old, self.seed = self.seed, new
        if old is not None:
            self._run(old.stop())

    def stop(self) -> None:
        """Withdraw and close the seed, and end its loop's thread."""
        try:
            if self.seed is not None:
                seed, self.seed = self.seed, None
                self._run(seed.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _run(self, coroutine: Coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
