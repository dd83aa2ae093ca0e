"""Waking up on time.

asyncio's sleeps wake late on Linux (the epoll timeout is rounded up to whole milliseconds),
a few percent of a WAN link's one-way delay (docs/measured.md, "wan clock"), so `sleep_until` sleeps to just before the deadline and
busy-waits the rest. The busy-wait yields to the event loop at every turn (`sleep(0)` polls I/O
without blocking), so other connections, and the reader queueing behind this very chunk, keep
running: a spin that did not yield starved them and cut a link's bandwidth. The price is
CPU while a delivery is due within `spin_s`; pass spin_s=0 to trade precision for CPU.
On a loaded machine a longer spin backfires (the spinning process gets descheduled), hence the
short default (docs/measured.md, "wan clock").
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
