"""One connection's state on the worker: greeting, replies in flight, and their backpressure.

Replies are written by several tasks (the reader, one per RESULT): one frame at a time and in
FIFO order, which keeps one connection's RESULTs in the order they were computed. Bytes of
replies not yet taken by the client count as unsent: RESULTs still computing (bounded from their
requests' shapes), replies waiting for the write lock, and the transport's buffer. The reader
stops reading that connection's requests while they exceed `max_unsent_bytes`, so a client that
pipelines requests and never reads cannot make the worker hold its replies without bound: at
most the bound plus one request's RESULT (and what the kernel's socket buffers hold).
"""

from __future__ import annotations

import asyncio
import time

from moeswarm.errors import printable
from moeswarm.wire.frames import Frame

# A closed connection's unsent bytes (a last ERROR on its way) get this long to leave; then the
# transport is aborted and its buffer released, whether the client read it or not.
CLOSE_GRACE_S = 5.0


async def within(seconds: float, awaitable):
    """`await awaitable`, raising TimeoutError after `seconds`."""
    if hasattr(asyncio, "timeout"):  # Python 3.11+: no extra task per wait
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class Session:
    """A connection: whether HELLO succeeded, its writer, its RESULT tasks and unsent reply bytes."""

    def __init__(self, writer: asyncio.StreamWriter, max_unsent_bytes: int):
        self.writer = writer
        self.peer = printable(str(writer.get_extra_info("peername")), 200)
        self.opened = time.monotonic()
        self.greeted = False
        self.held_bytes_peak = 0  # the largest request body read: big ones leave freed memory to hand back
        self.max_unsent_bytes = max_unsent_bytes
        self.replies: set[asyncio.Task] = set()
        self._write_lock = asyncio.Lock()
        self._pending = 0  # bytes of replies waiting for the write lock
        self._owed = 0  # bytes of RESULTs still being computed (an upper bound from the requests' shapes)
        self._room = asyncio.Event()
        self._room.set()

    @property
    def unsent(self) -> int:
        """Reply bytes owed to this client and not yet handed to the kernel: RESULTs computing (bounded
        from their requests' shapes), replies waiting for the write lock, the transport's buffer."""
        transport = self.writer.transport
        return self._owed + self._pending + (0 if transport.is_closing() else transport.get_write_buffer_size())

    def owe(self, size: int) -> None:
        """Count `size` bytes of a RESULT in the making (negative: it is made, or will never be)."""
        self._owed += size
        if size < 0:
            self._room.set()

    def track(self, task: asyncio.Task) -> None:
        self.replies.add(task)
        task.add_done_callback(self.replies.discard)

    async def send(self, frame: Frame, timeout_s: float) -> None:
        """Write a frame after the ones before it and wait for the client to take it (drain).

        TimeoutError after `timeout_s` (the client does not read): the caller closes the connection.
        """
        buffers = frame.encode()
        size = sum(memoryview(b).nbytes for b in buffers)
        self._pending += size
        written = False

        async def write() -> None:
            nonlocal written
            async with self._write_lock:
                self._pending -= size  # from here on the transport's buffer counts it
                written = True
                self.writer.writelines(buffers)
                await self.writer.drain()

        try:
            await within(timeout_s, write())
        finally:
            if not written:
                self._pending -= size
            self._room.set()  # the reader re-checks the unsent bytes

    def post(self, frame: Frame) -> None:
        """Queue a last frame without waiting (the connection closes after it).

        Safe next to `send`: a sender writes its whole frame in one call, with no await between
        taking the lock and writing, so frames never interleave.
        """
        if not self.writer.transport.is_closing():
            self.writer.writelines(frame.encode())

    async def wait_for_room(self, timeout_s: float) -> None:
        """Return once unsent replies are within bound; TimeoutError when the client takes none for `timeout_s`."""
        async def room() -> None:
            while self.unsent > self.max_unsent_bytes and not self.writer.transport.is_closing():
                self._room.clear()
                await self._room.wait()

        if self.unsent > self.max_unsent_bytes:
            await within(timeout_s, room())

    def end(self) -> None:
        """Cancel unsent RESULTs and close; a buffer the client does not take is dropped soon after."""
        for reply in list(self.replies):
            reply.cancel()
        transport = self.writer.transport
        self.writer.close()
        if transport.get_write_buffer_size() > 0:
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)

