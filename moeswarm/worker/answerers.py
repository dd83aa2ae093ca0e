"""The worker's answerers: the ways a DISPATCH is answered, one chain, and the two places it is walked.

A DISPATCH is answered one of three ways, each with the same bits (tests/test_call_paths.py):

- hold (worker/hold.py `Hold`): a connection held on the loop's thread between a decode's
  DISPATCHes; its next frames of a learned lane are read, answered and sent in C, by express's
  answers (the same C call for quantized experts, `Express.answer_now` for float ones);
- express (worker/express_answer.py `Express`): a frame whose metadata bytes the full path answered
  before, answered from its bytes: quantized experts in one C call (`QuantLane`), float ones by the
  store's own run or module (`TorchLane`, `OneCall`); whole, RESULT frame and all, on the loop
  (`answer_now`), or as a frame on the compute thread (`answer`);
- compute (worker/compute.py `Computation`): the full path on the compute thread: decode, check,
  the store's run (merged with other connections' DISPATCHes where it may), encode. It answers
  every frame, and teaches express the lanes it may answer next time (`Express.learn`).

The chain is walked in two places, and nowhere else:

- on the loop (`OnLoop.answer`), for a DISPATCH read whole (by the transport's callback,
  worker/server.py `_whole_frame`, or the connection's reader, worker/requests.py `handle`), when
  nothing computes and nothing is ahead of it on its connection: express answers it whole; then,
  from the transport's callback, the hold takes the connection for its next frames. Otherwise the
  frame is decoded and queued (worker/requests.py), and
- on the compute thread (`Computation.one`): each `Answerer` in turn (express, then compute) until
  one answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from moeswarm.wire.frames import HEADER_SIZE, Frame, Opcode
from moeswarm.worker.hold import selector_fd

if TYPE_CHECKING:
    from moeswarm.worker.express_answer import Express
    from moeswarm.worker.runner import ComputeRunner
    from moeswarm.worker.session import Session

log = logging.getLogger("moeswarm.worker")


class Answerer(Protocol):
    """One way the compute thread answers a DISPATCH frame (express, compute)."""

    name: str

    def answer(self, frame: Frame, sized: bool = False) -> Frame | None:
        """The reply to DISPATCH `frame` (a RESULT, or an ERROR naming what is wrong), or None: not this
        answerer's, the next one answers it. sized: the frame's declared sizes were checked already."""


class OnLoop:
    """The chain on the event loop: express answers a DISPATCH whole, then the hold keeps the connection."""

    def __init__(self, express: Express, runner: ComputeRunner, inline_tokens: int,
                 in_turn: Callable[[Session, Frame], None]):
        """inline_tokens: the most tokens a DISPATCH answered on the loop may have (0: none);
        in_turn: sends a reply on the loop after the ones ahead of it (worker/requests.py)."""
        self.express = express
        self.hold = express.hold
        self.runner = runner
        self.inline_tokens = inline_tokens
        self.in_turn = in_turn

    def answer(self, session: Session, request_id: int, meta_len: int, body: bytes,
               feed: Callable[[bytes], None] | None = None) -> bool:
        """Answer the DISPATCH with this request id and frame body (its metadata the first `meta_len`
        bytes) on the loop, its RESULT sent at once: True; False: it goes the usual way (decoded and
        queued). Its metadata has a whole-RESULT lane (express): those bytes passed every check before
        (the first frame with them went the full path), so the frame's size fits its limits and its
        RESULT (the size of its rows) the connection's bound. feed: the connection's reader, given a
        frame the hold read and did not answer; with it, the connection is held after the answer.
        Its header is not made into an object (the transport's callback: every small step counts there)."""
        if not session.greeted or not session.can_write_now():
            return False
        express = self.express
        lane = express.whole_lane(body, meta_len)
        if lane is None or lane.tokens > self.inline_tokens:
            return False
        ran, reply = self.runner.run_now(session, lambda: express.answer_now(lane, body, request_id), lane.tokens)
        if not ran or reply is None:
            return False
        session.slot.last_active = time.monotonic()
        if not session.write_buffers_now([reply], 0):  # a reply got ahead of it meanwhile: in turn
            meta_len = int.from_bytes(reply[16:20], "little")
            payload = reply[HEADER_SIZE + meta_len :]
            self.in_turn(session, Frame(Opcode.RESULT, request_id, {}, (payload,),
                                        bytes(reply[HEADER_SIZE : HEADER_SIZE + meta_len])))
        if feed is not None:
            self._hold(session, feed)
        return True

    def _hold(self, session: Session, feed: Callable[[bytes], None]) -> None:
        """Hold the connection for its next decode DISPATCHes, answered in C (worker/hold.py) while
        nothing else computes and nothing is unsent; `feed`: the connection's reader, given a frame
        the hold read and did not answer."""
        hold = self.hold
        fd, loop_fd = session.direct_fd, selector_fd(session.loop)
        if not hold.count or fd is None or loop_fd is None or not session.can_write_now():
            return
        ran, held = self.runner.run_now(session, lambda: hold.serve(fd, loop_fd, self.inline_tokens), 1)
        if not ran:
            return
        if held.answered:
            session.slot.last_active = time.monotonic()
            self.express.answered += held.in_c  # `answer_now` counted the others
            self.express.whole += held.in_c
            self.runner.charge(session, held.tokens - 1)
        if held.unsent and not session.write_buffers_now([memoryview(held.unsent)], 0):
            log.error("closing connection from %s: a held reply could not be sent in order", session.peer)
            session.writer.transport.abort()  # cannot happen: nothing else wrote while the hold ran
        if held.pending:
            feed(held.pending)
