"""Waking up on time.

asyncio's sleeps wake late by up to ~1 ms on Linux (the epoll timeout is rounded up to whole
milliseconds; measured here: p50 0.2-0.9 ms, max 1.6 ms). For a link whose one-way delay is
10-40 ms that is a few percent of error, so `sleep_until` sleeps to just before the deadline and
busy-waits the rest. The busy-wait yields to the event loop at every turn (`sleep(0)` polls I/O
without blocking), so other connections, and the reader queueing behind this very chunk, keep
running: a spin that did not yield starved them and cut a 1 gbit link to ~850 mbit. The price is
CPU while a delivery is due within `spin_s`; pass spin_s=0 to trade precision for CPU.
On a loaded machine a longer spin backfires (the spinning process gets descheduled): measured
with another job keeping both cores busy, 20 ms RTT p50 was 20.87 ms with no spin, 20.71 ms with
1.2 ms, 21.20 ms with 2 ms and 22.89 ms with 3 ms.
"""

from __future__ import annotations

import asyncio

DEFAULT_SPIN_S = 0.0012  # a little over the worst rounding of one epoll wait


async def sleep_until(when: float, spin_s: float = DEFAULT_SPIN_S) -> None:
    """Return at loop time `when` (asyncio clock), or as soon after as the loop allows."""
    loop = asyncio.get_running_loop()
    remaining = when - loop.time()
    if remaining > spin_s:
        await asyncio.sleep(remaining - spin_s)
    if spin_s > 0:
        while loop.time() < when:
            await asyncio.sleep(0)
    elif loop.time() < when:  # no spin: the plain sleep covered it (late by its granularity)
        await asyncio.sleep(when - loop.time())
