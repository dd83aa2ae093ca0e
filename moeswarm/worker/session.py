"""One connection's state on the worker: greeting, replies in flight, and their backpressure.

Replies are written one frame at a time and in FIFO order, which keeps one connection's RESULTs
in the order they were computed. A RESULT leaves from the compute thread itself when nothing is
ahead of it (`write_now`: a plain TCP connection, an empty transport buffer, no earlier reply on
its way): one non-blocking `sendmsg` on the socket, no wake-up of the event loop. Otherwise, and
for every other reply, the loop writes it (`send`, `post`). A lock orders the two writers; bytes
a direct send could not hand to the kernel (`tail`) go out before anything else the loop writes.

Bytes of replies not yet taken by the client count as unsent: RESULTs still computing (bounded
from their requests' shapes before they are queued), replies waiting to be written, and the
transport's buffer. A DISPATCH whose RESULT would take them over `max_unsent_bytes` waits
(`wait_for_room(need=...)`) until the client took earlier ones, and no RESULT is larger than the
bound (worker/replies.py), so a client that pipelines requests and never reads makes the worker
hold at most the bound of its replies (besides what the kernel's socket buffers hold).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

from moeswarm.deadline import within
from moeswarm.errors import printable
from moeswarm.wire.frames import Frame

# A closed connection's unsent bytes (a last ERROR on its way) get this long to leave; then the
# transport is aborted and its buffer released, whether the client read it or not.
CLOSE_GRACE_S = 5.0


class Session:
    """A connection: whether HELLO succeeded, its writer, its RESULT tasks and unsent reply bytes.

    Created and ended on the event loop; `settle` and `write_now` may also be called from the
    compute thread.
    """

    def __init__(self, writer: asyncio.StreamWriter, max_unsent_bytes: int):
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.peer = printable(str(writer.get_extra_info("peername")), 200)
        self.opened = time.monotonic()
        self.greeted = False
        self.slot = None  # its worker/admission.py Slot: activity, eviction
        self.progress_at = self.opened  # when its client last took reply bytes (the worker's reply watch)
        self.last_waiting = 0
        self.held_bytes_peak = 0  # the largest request body read: big ones leave freed memory to hand back
        self.max_unsent_bytes = max_unsent_bytes
        self.replies: set[asyncio.Task] = set()
        self.closed = False
        self._lock = threading.Lock()  # the socket's writes and the counts both threads change
        self._direct = _direct_socket(writer)  # the compute thread's own handle on the socket (None: TLS)
        self._tail: list[memoryview] = []  # a direct send's bytes the kernel did not take yet: they go first
        self._write_lock = asyncio.Lock()
        self._queued = 0  # RESULTs handed to the loop and not yet written: later RESULTs wait behind them
        self._pending = 0  # bytes of replies waiting to be written (a tail included)
        # Bytes of RESULTs still being computed (an upper bound from the requests' shapes): counted in
        # by the loop alone, without the lock (a DISPATCH never waits for a send on the compute thread),
        # and out under the lock; each count has one writer at a time.
        self._owed_in = 0
        self._owed_out = 0
        self._waiting_room = False  # the reader waits for unsent bytes to drop (wake it from the compute thread)
        self._room = asyncio.Event()
        self._room.set()

    @property
    def unsent(self) -> int:
        """Reply bytes owed to this client and not yet handed to the kernel: RESULTs computing (bounded
        from their requests' shapes), replies waiting to be written, the transport's buffer."""
        transport = self.writer.transport
        return self.owed + self._pending + (0 if transport.is_closing() else transport.get_write_buffer_size())

    @property
    def owed(self) -> int:
        """Bytes of RESULTs still being computed (bounded from their requests' shapes)."""
        return self._owed_in - self._owed_out

    @property
    def written_unsent(self) -> int:
        """Reply bytes written (or waiting to be) that the client has not taken yet."""
        transport = self.writer.transport
        return self._pending + (0 if transport.is_closing() else transport.get_write_buffer_size())

    def wake(self) -> None:
        """Let a reader waiting for room look again (its connection may be closing)."""
        self._room.set()

    def owe(self, size: int) -> None:
        """Count `size` bytes of a RESULT in the making (on the loop); `settle` them once it is made or never will be."""
        self._owed_in += size

    def settle(self, size: int) -> None:
        """The `size` bytes `owe` counted are no longer owed (any thread)."""
        with self._lock:
            self._owed_out += size
            wake = self._waiting_room
        if wake:
            self._wake_reader()

    def track(self, task: asyncio.Task) -> None:
        self.replies.add(task)
        task.add_done_callback(self.replies.discard)

    # -- the compute thread's way out ----------------------------------------------------------------

    def write_now(self, frame: Frame, owed: int) -> bool:
        """Send a RESULT from the compute thread if nothing is ahead of it; True when it was dealt with
        (written whole, or the rest of it left as the tail the loop writes first, or the connection
        is gone). False: the loop must `send` it after the replies ahead of it (then it is counted as
        waiting). `owed`: what the request counted for it while computing, released here."""
        return self.write_buffers_now([memoryview(b).cast("B") for b in frame.encode()], owed)

    def can_write_now(self) -> bool:
        """Whether a reply handed to `write_buffers_now` now would go straight to the socket (a plain
        TCP connection, nothing ahead of it)."""
        return (self._direct is not None and not self.closed and not self._queued and not self._tail
                and not self.writer.transport.get_write_buffer_size())

    @property
    def direct_fd(self) -> int | None:
        """The descriptor of the compute thread's handle on a plain TCP connection (None: TLS)."""
        return None if self._direct is None else self._direct.fileno()

    def write_buffers_now(self, buffers: list[memoryview], owed: int) -> bool:
        """`write_now` of a frame already encoded (its buffers, header first)."""
        size = sum(b.nbytes for b in buffers)
        with self._lock:
            self._owed_out += owed
            transport = self.writer.transport
            if self.closed or transport.is_closing():
                return True  # nobody to answer: the connection is closing
            if self._direct is None or self._queued or self._tail or transport.get_write_buffer_size():
                self._queued += 1
                self._pending += size
                return False
            try:
                sent = self._direct.sendmsg(buffers)
            except BlockingIOError:
                sent = 0
            except OSError:  # the peer went away: the reader finds out and closes the connection
                return True
            if sent < size:
                self._tail = _after(buffers, sent)
                self._pending += size - sent
                try:
                    self.loop.call_soon_threadsafe(self._write_tail)
                except RuntimeError:  # the loop is closed: the worker is stopping, nobody reads any more
                    return True
            wake = self._waiting_room
        if wake:
            self._wake_reader()
        return True

    # -- the event loop's writes ------------------------------------------------------------------

    async def send(self, frame: Frame, timeout_s: float, queued: bool = False) -> None:
        """Write a frame after the ones before it and wait for the client to take it (drain).

        queued: a RESULT `write_now` handed over (its bytes are counted as waiting already).
        TimeoutError after `timeout_s` (the client does not read): the caller closes the connection.
        """
        buffers = frame.encode()
        size = sum(memoryview(b).nbytes for b in buffers)
        if not queued:
            with self._lock:
                self._pending += size
        written = False

        async def write() -> None:
            nonlocal written
            async with self._write_lock:
                self._write(buffers, size, queued)  # from here on the transport's buffer counts it
                written = True
                await self.writer.drain()

        try:
            await within(timeout_s, write())
        finally:
            if not written:
                with self._lock:
                    self._pending -= size
                    self._queued -= queued
            self._room.set()  # the reader re-checks the unsent bytes

    def post(self, frame: Frame) -> None:
        """Queue a last frame without waiting (the connection closes after it).

        Safe next to `send`: a sender writes its whole frame in one call, with no await between
        taking the lock and writing, so frames never interleave.
        """
        if not self.writer.transport.is_closing():
            self._write(frame.encode(), 0, False)

    def _write(self, buffers: list, size: int, queued: bool) -> None:
        """Hand a whole frame to the transport, after any tail of a direct send (the loop's thread)."""
        with self._lock:
            self._flush_tail_locked()
            self._pending -= size
            self._queued -= queued
            if not self.writer.transport.is_closing():
                self.writer.writelines(buffers)

    def _write_tail(self) -> None:
        """The loop's part of a direct send the kernel did not take whole: write the rest, and wake
        the reader once the client took it (it may be waiting for room)."""
        if self.closed:
            return
        with self._lock:
            self._flush_tail_locked()

        async def drained() -> None:
            try:
                await self.writer.drain()
            except (ConnectionError, OSError):  # the reader finds the connection gone and ends it
                pass
            finally:
                self._room.set()

        self.track(self.loop.create_task(drained()))

    def _flush_tail_locked(self) -> None:
        if self._tail:
            tail, self._tail = self._tail, []
            self._pending -= sum(b.nbytes for b in tail)
            if not self.writer.transport.is_closing():
                self.writer.writelines(tail)

    def _wake_reader(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._room.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    async def wait_for_room(self, timeout_s: float, need: int = 0) -> None:
        """Return once unsent replies leave room for `need` more bytes within the bound (or nothing is
        unsent); TimeoutError when the client takes none for `timeout_s`."""
        def full() -> bool:
            unsent = self.unsent
            return unsent > 0 and unsent + need > self.max_unsent_bytes

        async def room() -> None:
            while True:
                with self._lock:  # the compute thread sees the flag, or this check sees its release
                    self._room.clear()
                    self._waiting_room = full() and not self.writer.transport.is_closing()
                    if not self._waiting_room:
                        return
                await self._room.wait()

        if full():
            try:
                await within(timeout_s, room())
            finally:
                self._waiting_room = False

    def shut(self) -> None:
        """No reply is written from here on but what is written already (the transport still flushes)."""
        with self._lock:
            self.closed = True
            if self._direct is not None:
                self._direct.close()  # after this no thread writes to the socket but the transport
                self._direct = None

    def end(self) -> None:
        """Cancel unsent RESULTs and close; a buffer the client does not take is dropped soon after."""
        for reply in list(self.replies):
            reply.cancel()
        self.shut()
        transport = self.writer.transport
        # read before closing: a closed TLS transport has no buffer to ask about any more
        left = 0 if transport.is_closing() else transport.get_write_buffer_size()
        self.writer.close()
        if left > 0:
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)


def _direct_socket(writer: asyncio.StreamWriter) -> socket.socket | None:
    """A duplicate of a plain TCP connection's socket, for the compute thread's sends; None over TLS.

    A duplicate, not the transport's own descriptor: when the transport closes its descriptor, the
    number can be reused by the next connection at once, and a late send would reach that one.
    """
    raw = writer.get_extra_info("socket")
    if raw is None or writer.get_extra_info("sslcontext") is not None or raw.family not in (
            socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
        return None
    try:
        direct = socket.socket(fileno=os.dup(raw.fileno()))
    except OSError:
        return None
    direct.setblocking(False)
    return direct


def _after(buffers: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of `buffers` once their first `sent` bytes went out."""
    for i, buffer in enumerate(buffers):
        if sent < buffer.nbytes:
            return [buffer[sent:], *buffers[i + 1 :]]
        sent -= buffer.nbytes
    return []
