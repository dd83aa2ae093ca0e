"""When does a chunk arrive? The link model, one direction at a time.

A chunk of n bytes sent at `now` queues behind the chunks already on the wire, occupies the link
for its serialization time, then travels for the propagation delay:

    depart = max(now, link_free_at) + n * 8 / bandwidth      (link_free_at = depart)
    arrive = max(depart + rtt / 2 + U(-jitter, +jitter), previous arrive)

The max with the previous arrival keeps delivery monotonic, so jitter never reorders bytes (a
chunk held back by jitter holds back the ones behind it, as on a real FIFO path).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from moeswarm_bench.wan.link import LinkProfile


class Channel:
    """One direction of the emulated link, shared by every connection through the proxy."""

    def __init__(self, profile: Callable[[], LinkProfile], rng: random.Random):
        self._profile = profile  # read at every chunk: profile changes apply to later chunks
        self._rng = rng
        self._free_at = 0.0
        self._last_arrival = 0.0

    def capped(self) -> bool:
        return self._profile().bandwidth_bps is not None

    def schedule(self, n_bytes: int, now: float) -> float:
        """Reserve the link for `n_bytes` sent at `now`; return the arrival time (loop clock)."""
        profile = self._profile()
        depart = now
        if profile.bandwidth_bps is not None:
            depart = max(now, self._free_at) + n_bytes * 8 / profile.bandwidth_bps
            self._free_at = depart
        delay = profile.one_way_s
        if profile.jitter_s > 0:
            delay = max(0.0, delay + self._rng.uniform(-profile.jitter_s, profile.jitter_s))
        arrival = max(depart + delay, self._last_arrival)
        self._last_arrival = arrival
        return arrival
