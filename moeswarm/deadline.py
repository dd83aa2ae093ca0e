"""`within(seconds, awaitable)`: an await with a deadline that never loses a cancellation.

Python 3.11's `asyncio.wait_for` returns the inner result when a cancellation arrives in the same
loop turn as that result (CPython gh-86296), so a task cancelled at shutdown may run on; a relay
attachment then re-registered and sat out its 60 s keepalive. `asyncio.timeout` (3.11+) keeps
the cancellation and needs no extra task; 3.10 falls back to `wait_for`.
"""

from __future__ import annotations

import asyncio


async def within(seconds: float, awaitable):
    """`await awaitable`, raising TimeoutError after `seconds`."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)
