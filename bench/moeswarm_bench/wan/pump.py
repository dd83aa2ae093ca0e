"""One direction of one proxied connection: read, schedule on the link, deliver on time.

A reader task stamps each chunk with its arrival time (Channel.schedule) and queues it; a sender
task sleeps until that time and writes it out. Ends of stream travel the same way: an EOF from
the source becomes a half-close (write_eof) at the sink one delay later, and a reset of the
source becomes a ConnectionResetError at delivery time, which aborts the whole connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from moeswarm_bench.wan.channel import Channel
from moeswarm_bench.wan.clock import sleep_until
from moeswarm_bench.wan.faults import Faults

READ_BYTES = 64 * 1024
SEGMENT_BYTES = 16 * 1024  # with a bandwidth cap, chunks are cut so delivery streams smoothly
MAX_QUEUED_BYTES = 32 * 1024 * 1024  # beyond this the reader stops: TCP backpressure upstream

_DATA, _EOF, _RESET = "data", "eof", "reset"


class BudgetSpent(Exception):
    """The close-after byte budget of the connection is used up: close it."""


class Pump:
    """Moves bytes from `source` to `sink` through `channel`.

    allowance: returns how many more bytes may be delivered (None = no limit); when a delivery
        uses it up the pump writes what fits and raises BudgetSpent.
    """

    def __init__(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        channel: Channel,
        faults: Faults,
        *,
        spin_s: float,
        allowance: Callable[[int], int | None] = lambda forwarded: None,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ):
        self._source = source
        self._sink = sink
        self._channel = channel
        self._faults = faults
        self._spin_s = spin_s
        self._allowance = allowance
        self._max_queued = max_queued_bytes
        self._queue: asyncio.Queue[tuple[float, str, bytes]] = asyncio.Queue()
        self._queued_bytes = 0
        self._space = asyncio.Event()
        self._space.set()
        self.forwarded = 0

    async def run(self) -> None:
        reader = asyncio.ensure_future(self._read())
        try:
            await self._send()
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await self._source.read(READ_BYTES)
            except (ConnectionError, OSError):
                self._enqueue(self._channel.schedule(0, loop.time()), _RESET, b"")
                return
            if not data:
                self._enqueue(self._channel.schedule(0, loop.time()), _EOF, b"")
                return
            step = SEGMENT_BYTES if self._channel.capped() else len(data)
            for start in range(0, len(data), step):
                segment = data[start : start + step]
                while self._queued_bytes >= self._max_queued:
                    self._space.clear()
                    await self._space.wait()
                self._enqueue(self._channel.schedule(len(segment), loop.time()), _DATA, segment)

    def _enqueue(self, arrival: float, kind: str, data: bytes) -> None:
        self._queued_bytes += len(data)
        self._queue.put_nowait((arrival, kind, data))

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            arrival, kind, data = await self._queue.get()
            await sleep_until(arrival, self._spin_s)
            while self._faults.stall_until > loop.time():  # re-check: a stall may be extended
                await sleep_until(self._faults.stall_until, self._spin_s)
            self._queued_bytes -= len(data)
            self._space.set()
            if kind == _RESET:
                raise ConnectionResetError("the other side reset the connection")
            if kind == _EOF:
                if self._sink.can_write_eof():
                    with contextlib.suppress(OSError):
                        self._sink.write_eof()
                return
            allowed = self._allowance(self.forwarded)
            if allowed is not None and len(data) >= allowed:
                self._sink.write(data[:allowed])
                self.forwarded += max(0, allowed)
                await self._sink.drain()
                raise BudgetSpent()
            self._sink.write(data)
            self.forwarded += len(data)
            await self._sink.drain()
