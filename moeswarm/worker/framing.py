"""Reading one request frame on the worker, within its limits and deadlines.

The first byte of a frame may take up to the idle timeout (or what is left of the HELLO timeout),
watched by one timer per connection (`IdleWatch`) rather than one per frame; from then on the
rest of the header and the whole body must arrive within the frame timeout, so a peer that sends
a few bytes and stalls is cut off. A frame that is whole in the reader's buffer by then (a small
DISPATCH, a PING) is taken without arming that timer: it cannot stall. The header's lengths are
checked before anything else is read: against the payload limit, against the small limit before
HELLO, and against the worker's byte budget. A body over the budget is read in small chunks and dropped
(the stream stays in step) and the request is answered "busy".
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from moeswarm.errors import ProtocolError
from moeswarm.wire.frames import HEADER_SIZE, Header, parse_header
from moeswarm.worker.limits import ByteBudget, WorkerLimits
from moeswarm.deadline import within

DISCARD_CHUNK = 64 << 10
_LENGTHS = struct.Struct("<II")  # meta_len, payload_len: the header's last 8 bytes
_LENGTHS_AT = HEADER_SIZE - _LENGTHS.size


class FrameFault(Exception):
    """The stream cannot be trusted past this point: answer ERROR `code` and close the connection."""

    def __init__(self, code: str, message: str, request_id: int = 0):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class Idle(Exception):
    """No frame began within the allowed time."""


@dataclass
class Incoming:
    """A frame read whole, or one whose body was dropped unread (`body` None: over the byte budget)."""

    header: Header
    body: bytes | None
    reserved: int  # bytes taken from the budget: give them back when the request is done


class IdleWatch:
    """A connection's wait for the first byte of its next frame, bounded by one timer that is moved
    only when it fires: a frame that came meanwhile pushed the deadline later, so the timer is set
    again for the new one. Per frame this costs a float, where a timeout per frame costs a timer
    handle set and cancelled (the event loop's heap, twice) on the path of every DISPATCH.

    Made inside the connection's task, which the timer cancels when the deadline passes (then the
    wait raises Idle). Python 3.10 has no Task.uncancel: there each wait takes its own timeout."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._deadline: float | None = None  # of the wait in progress; None between waits
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def first_byte(self, reader: asyncio.StreamReader, wait_s: float) -> bytes:
        if not hasattr(self._task, "uncancel"):
            return await within(wait_s, reader.readexactly(1))
        self._deadline = deadline = self._loop.time() + wait_s
        if self._timer is None or self._timer.when() > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(deadline, self._fire)
        try:
            return await reader.readexactly(1)
        except asyncio.CancelledError:
            if not self._expired:
                raise
            self._expired = False
            self._task.uncancel()
            raise Idle from None
        finally:
            self._deadline = None

    @property
    def waiting(self) -> bool:
        """Whether the connection's reader waits for the first byte of a frame (between frames)."""
        return self._deadline is not None

    def renew(self, wait_s: float) -> None:
        """A frame was answered without the reader (worker/server.py `_whole_frame`): the wait in
        progress may last `wait_s` from now."""
        if self._deadline is not None:
            self._deadline = max(self._deadline, self._loop.time() + wait_s)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        if self._deadline is None:  # between waits: the next one sets the timer again
            return
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._fire)
            return
        self._expired = True
        self._task.cancel()


async def read_frame(reader: asyncio.StreamReader, limits: WorkerLimits, budget: ByteBudget,
                     greeted: bool, wait_s: float, watch: IdleWatch | None = None) -> Incoming | None:
    """The next frame; None at a clean end of stream (no byte of a new frame).

    Raises Idle when no frame begins within `wait_s` (watched by `watch`, or a timeout of its own),
    FrameFault when the framing breaks.
    """
    try:
        if buffered(reader):  # pipelined: the next frame has begun already, nothing to wait for
            first = await reader.readexactly(1)
        elif watch is not None:
            first = await watch.first_byte(reader, wait_s)
        else:
            first = await within(wait_s, reader.readexactly(1))
    except asyncio.IncompleteReadError:
        return None
    except asyncio.TimeoutError:
        raise Idle from None
    progress = _Progress()
    try:
        rest = _rest(reader, first, limits, budget, greeted, progress)
        if _whole_frame_buffered(reader, first):  # the usual case: nothing of it can stall, no timer needed
            return await rest
        return await within(limits.frame_timeout_s, rest)
    except asyncio.TimeoutError:
        budget.give(progress.reserved)
        if progress.header is None:
            raise FrameFault("truncated", f"truncated frame header: not received within {limits.frame_timeout_s:g} s "
                                          "of its first byte") from None
        raise FrameFault("truncated", f"truncated frame: body of {progress.header.body_len} bytes not received "
                                      f"within {limits.frame_timeout_s:g} s", progress.header.request_id) from None
    except BaseException:
        budget.give(progress.reserved)
        raise


def buffered(reader: asyncio.StreamReader) -> int:
    """Bytes the reader holds already (0 when this asyncio keeps them elsewhere: the timed path then)."""
    buffer = getattr(reader, "_buffer", None)
    return len(buffer) if isinstance(buffer, bytearray) else 0


def _whole_frame_buffered(reader: asyncio.StreamReader, first: bytes) -> bool:
    """Whether the rest of the frame that starts with `first` is in the reader's buffer already (its
    lengths are only peeked at here: `_rest` checks the header)."""
    held = buffered(reader)
    if held < HEADER_SIZE - 1:
        return False
    meta_len, payload_len = _LENGTHS.unpack_from(reader._buffer, _LENGTHS_AT - 1)
    return held >= HEADER_SIZE - 1 + meta_len + payload_len


@dataclass
class _Progress:
    header: Header | None = None
    reserved: int = 0


async def _rest(reader: asyncio.StreamReader, first: bytes, limits: WorkerLimits, budget: ByteBudget,
                greeted: bool, progress: _Progress) -> Incoming:
    try:
        head = first + await reader.readexactly(HEADER_SIZE - 1)
    except asyncio.IncompleteReadError as eof:
        raise FrameFault("truncated", f"truncated frame header: {1 + len(eof.partial)} of {HEADER_SIZE} bytes") from None
    try:
        header = parse_header(head, limits.max_payload)
    except ProtocolError as error:
        raise FrameFault("framing", str(error)) from None
    if not greeted and header.body_len > limits.hello_max_bytes:
        raise FrameFault("framing", f"frame of {header.body_len} bytes before HELLO is over the limit of "
                                    f"{limits.hello_max_bytes}", header.request_id)
    progress.header = header
    if budget.take(header.body_len):
        progress.reserved = header.body_len
        body = await _read_body(reader, header)
        return Incoming(header, body, header.body_len)
    await _discard_body(reader, header)
    return Incoming(header, None, 0)


async def _read_body(reader: asyncio.StreamReader, header: Header) -> bytes:
    try:
        return await reader.readexactly(header.body_len)
    except asyncio.IncompleteReadError as eof:
        raise FrameFault("truncated", f"truncated frame: body of {header.body_len} bytes, got {len(eof.partial)}",
                         header.request_id) from None


async def _discard_body(reader: asyncio.StreamReader, header: Header) -> None:
    """Read and drop a body without holding more than one chunk of it."""
    left = header.body_len
    while left:
        try:
            left -= len(await reader.readexactly(min(left, DISCARD_CHUNK)))
        except asyncio.IncompleteReadError as eof:
            got = header.body_len - left + len(eof.partial)
            raise FrameFault("truncated", f"truncated frame: body of {header.body_len} bytes, got {got}",
                             header.request_id) from None
