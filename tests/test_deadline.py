"""`within` keeps a cancellation that lands in the same loop turn as the awaited result: Python
3.11's `asyncio.wait_for` returns the result instead, and a relay attachment cancelled at shutdown
ran on (re-registered, then waited out its keepalive)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from moeswarm.deadline import within


async def _cancelled_as_it_completes() -> str:
    loop = asyncio.get_running_loop()
    result = loop.create_future()

    async def waiting():
        return await result

    task = asyncio.ensure_future(within(10, waiting()))
    for _ in range(3):
        await asyncio.sleep(0)  # the task is parked on `result`
    result.set_result("done")
    task.cancel()  # the same turn: both reach the task together
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 has no asyncio.timeout: within falls back to wait_for")
def test_a_cancellation_arriving_with_the_result_is_kept():
    assert asyncio.run(_cancelled_as_it_completes()) == "cancelled"


def test_the_deadline_raises_timeout_and_passes_results():
    async def slow():
        await asyncio.sleep(5)

    async def both():
        with pytest.raises(asyncio.TimeoutError):
            await within(0.05, slow())
        return await within(1, asyncio.sleep(0, result=7))

    assert asyncio.run(both()) == 7
