"""A connection held between a decode's DISPATCHes: the next ones read, answered and sent in C.

A decode step's DISPATCH answered whole on the event loop (worker/express_answer.py `answer_now`) is
followed, a backbone's attention later, by the next layer's. Through the loop each one costs the
loop's wake-up, the transport's read and callbacks, the lane's lookup and the reply's send, all in
Python from caches the experts just swept: a large part of a layer call's time beyond its
experts (docs/measured.md, "hold"). So after such an answer the loop's thread waits on the connection itself, in C
(kernels/qk_hold.c): a frame of a learned lane (its metadata bytes the lane's, its payload the
lane's size) is read, answered by the express entries (the same calls, the same bits) and sent,
and the wait goes on.

The hold gives the loop back as soon as it has anything else to do: it waits on the loop's
selector too, so another connection's bytes, a reply finished on the compute thread, or a new
connection end it; so do bytes on this connection that are not a learned lane's frame (read by the
loop's reader, with every check of its own), HOLD_WAIT_S without a frame, and HOLD_LIMIT_S in all
(the loop's timers wait that long at most). It runs as the runner's work (nothing else computes
meanwhile) and only on a plain TCP connection with nothing unsent.

`Hold` is the lanes a hold knows and its C call; `HeldConnection` is the hold as one of the
worker's answerers (worker/answerers.py), first in their chain.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeswarm.kernels import qkernels
from moeswarm.wire.frames import HEADER_SIZE, Frame
from moeswarm.worker.config import INLINE_TOKENS

if TYPE_CHECKING:
    from moeswarm.worker.answerers import LoopSide
    from moeswarm.worker.express_answer import Express, LearnedLane
    from moeswarm.worker.session import Session

log = logging.getLogger("moeswarm.worker")

HOLD_WAIT_S = 0.05  # the longest a hold waits for the connection's next frame
HOLD_LIMIT_S = 0.1  # the longest one hold keeps the loop's thread
CAPACITY = 256  # lanes a hold knows (one per layer, mode and timing, per token count), kept for good

# why a hold ended (kernels/qk_hold.c)
WAITED, LOOP, OTHER, DECLINED, FULL, CLOSED, SPENT = range(7)


@dataclass(frozen=True)
class Held:
    """What one hold did."""

    answered: int  # frames answered (their replies sent, or `unsent` the rest of the last one)
    in_c: int  # of them, by the express entries in C (the others by `answer`, which counts its own)
    tokens: int  # their tokens
    pending: bytes  # a frame read and not answered (DECLINED): the loop's reader takes it
    unsent: bytes  # the last reply's bytes the socket did not take (FULL): the loop writes them


class Hold:
    """The lanes a connection hold answers and its buffers: express lanes whose whole RESULT is made in
    C, and others (float experts: a torch module's) that `answer(lane, body, request_id)` answers
    (worker/express_answer.py `answer_now`: the whole RESULT frame, or None), called from the hold.
    Lanes are added on the compute thread, holds run on the loop's: a hold sees the lanes counted
    when it began, and the runner keeps the two apart (both run as its work)."""

    def __init__(self, answer: Callable[[object, memoryview, int], memoryview | None], capacity: int = CAPACITY):
        self._answer = answer
        self._lanes = (qkernels.HoldLane * capacity)()
        self._kept: list = []  # what the entries point into
        self._python: dict[int, object] = {}  # entry -> the lane `answer` answers
        self._callback = qkernels.HOLD_ANSWER(self._called)
        self.count = 0
        self._sizes: list[tuple[int, int, int]] = []  # each lane's (tokens, DISPATCH frame bytes, RESULT frame bytes)
        self._sized = (0, 0)  # (lanes, max_tokens) the buffers were sized for
        self._in = bytearray()
        self._reply = bytearray()
        self._out = qkernels.HoldOut()
        self._by_python = 0  # frames `answer` answered in the hold under way
        self.answered = 0  # frames answered in holds

    def add(self, meta: bytes, lane: LearnedLane) -> None:
        """A lane (worker/express_answer.py `LearnedLane`, answering whole): DISPATCHes whose metadata
        bytes are `meta`, answered in C where the lane says (`in_c`), else by `answer` (`lane` given to it)."""
        if self.count == len(self._lanes) or lane.tokens > INLINE_TOKENS:
            return  # the loop's express lane and the full path still answer it
        in_c = lane.in_c()
        whole, exact = in_c if in_c is not None else (None, False)
        kept = ctypes.create_string_buffer(meta, len(meta))
        self._kept.append((kept, whole))
        if whole is None:
            self._python[self.count] = lane
        self._lanes[self.count] = qkernels.HoldLane(ctypes.addressof(kept), len(meta), lane.payload_bytes,
                                                    ctypes.addressof(whole[0]) if whole is not None else None,
                                                    int(exact), lane.tokens)
        self._sizes.append((lane.tokens, HEADER_SIZE + len(meta) + lane.payload_bytes, lane.reply_bytes))
        self.count += 1

    def serve(self, fd: int, loop_fd: int, max_tokens: int) -> Held:
        """Hold connection `fd` (its socket's descriptor) with the lanes of at most `max_tokens` until
        one of the ends above, the kernels on torch's thread count (as the express lane's); `loop_fd`:
        the event loop's selector."""
        if self._sized != (self.count, max_tokens):
            fitting = [(frame, reply) for tokens, frame, reply in self._sizes if tokens <= max_tokens]
            frame_bytes, reply_bytes = (max(sizes) for sizes in zip(*fitting)) if fitting else (0, 0)
            if len(self._in) < frame_bytes:
                self._in = bytearray(frame_bytes)
            if len(self._reply) < reply_bytes:
                self._reply = bytearray(reply_bytes)
            self._sized = (self.count, max_tokens)
        out, self._by_python = self._out, 0
        why = qkernels.hold(self._lanes, self.count, max_tokens, fd, loop_fd, HOLD_WAIT_S, HOLD_LIMIT_S, self._in,
                            self._reply, self._callback, torch.get_num_threads(), out)
        self.answered += out.answered
        pending = bytes(self._in[: out.pending]) if why == DECLINED else b""
        unsent = bytes(self._reply[out.unsent_at : out.unsent_at + out.unsent_len]) if why == FULL else b""
        return Held(out.answered, out.answered - self._by_python, out.tokens, pending, unsent)

    def _called(self, index: int, body_at: int, body_len: int, request_id: int, reply_at: int, room: int) -> int:
        """qk_hold's call for a lane without an ExpressLane: `answer`'s RESULT frame copied into the
        reply buffer; its length, or -1 (declined, or larger than the room: the loop's reader takes
        the frame, and the full path answers it)."""
        try:
            body = memoryview((ctypes.c_char * body_len).from_address(body_at)).cast("B")
            reply = self._answer(self._python[index], body, request_id)
            if reply is None or reply.nbytes > room:
                return -1
            memoryview((ctypes.c_char * room).from_address(reply_at)).cast("B")[: reply.nbytes] = reply
        except Exception:  # noqa: BLE001 - a bug: the full path answers the frame again and says what it is
            return -1
        self._by_python += 1
        return reply.nbytes


class HeldConnection:
    """The hold as one of the worker's answerers (worker/answerers.py): a DISPATCH read whole by the
    transport's callback (worker/server.py `_whole_frame`) is answered whole by express on the loop,
    then the connection is held for its next frames, answered in C by `hold` (express's lanes)."""

    name = "hold"

    def __init__(self, express: Express):
        self.express = express
        self.hold = express.hold

    def answer(self, frame: Frame, sized: bool = False) -> None:
        """None: a frame on the compute thread was not read by a hold (the next answerers' own)."""
        return None

    def answer_on_loop(self, loop: LoopSide, session: Session, request_id: int, meta_len: int, body: bytes,
                       feed: Callable[[bytes], None] | None) -> bool:
        """The transport's callback's DISPATCH (`feed`: the connection's reader, given a frame the hold
        reads and does not answer; None: not the callback's, the next answerers' own) answered whole by
        express and its RESULT sent: True, the connection then held; False: it goes the usual way."""
        if feed is None or not self.express.answer_whole_on_loop(loop, session, request_id, meta_len, body):
            return False
        self._hold(loop, session, feed)
        return True

    def _hold(self, loop: LoopSide, session: Session, feed: Callable[[bytes], None]) -> None:
        """Hold the connection for its next decode DISPATCHes, answered in C while nothing else computes
        and nothing is unsent; `feed`: the connection's reader, given a frame the hold read and did not
        answer."""
        hold = self.hold
        fd, loop_fd = session.direct_fd, selector_fd(session.loop)
        if not hold.count or fd is None or loop_fd is None or not session.can_write_now():
            return
        ran, held = loop.runner.run_now(session, lambda: hold.serve(fd, loop_fd, loop.inline_tokens), 1)
        if not ran:
            return
        if held.answered:
            session.slot.last_active = time.monotonic()
            self.express.answered += held.in_c  # `answer_now` counted the others
            self.express.whole += held.in_c
            loop.runner.charge(session, held.tokens - 1)
        if held.unsent and not session.write_buffers_now([memoryview(held.unsent)], 0):
            log.error("closing connection from %s: a held reply could not be sent in order", session.peer)
            session.writer.transport.abort()  # cannot happen: nothing else wrote while the hold ran
        if held.pending:
            feed(held.pending)


def selector_fd(loop) -> int | None:
    """The descriptor of `loop`'s selector (readable when anything it waits for is ready), or None
    where the loop has none to offer (a loop other than asyncio's selector loop)."""
    selector = getattr(loop, "_selector", None)  # asyncio's BaseSelectorEventLoop: no public handle
    fileno = getattr(selector, "fileno", None)
    try:
        return fileno() if fileno is not None else None
    except (OSError, ValueError):
        return None
