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

from moeswarm.node.member_seed import ShareSeed

if TYPE_CHECKING:
    from moeswarm.node.member_seed import MemberSeed


class SpanSeed:
    """The seed of a stage member's current span, replaced when the span moves (node/stage_member.py):
    a ShareSeed of spans, driven from the member's threads through an event loop of its own.

    open_seed(span, first): the MemberSeed of that span's kept pieces, or None (not kept); `first`
    is True for the span the member joined with (it may take `--seed-port`)."""

    def __init__(self, open_seed: Callable[[range, bool], MemberSeed | None], report: Callable[[str], None]):
        self._share = ShareSeed(open_seed, report, "span")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="moeswarm-stage-seed", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str | None:
        """The seed's announced HOST:PORT (None: not seeding)."""
        return self._share.seed.address if self._share.seed is not None else None

    def follow(self, span: range) -> None:
        """Seed the pieces of `span`'s slice: the new seed started and announced first, then the old
        one withdrawn and closed."""
        self._run(self._share.follow(span))

    def stop(self) -> None:
        """Withdraw and close the seed, and end its loop's thread."""
        try:
            self._run(self._share.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _run(self, coroutine: Coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
