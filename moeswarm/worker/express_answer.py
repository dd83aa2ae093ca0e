"""Express: a DISPATCH whose metadata bytes the full path answered before, answered from its bytes.

A lane is learned from a request the full path answered (worker/compute.py): its metadata bytes
(wire/layouts.py) fix everything the full path checked but the tensors' values, so the next frame
with the same bytes passes the same checks. Each lane kind (`LearnedLane`) answers its frames
itself, with the full path's bits: quantized experts in one C call (worker/quant_lane.py), float
ones by the store's own run or module (worker/torch_lane.py). Express knows them only through
`LearnedLane` and the kinds it is given (worker/answerers.py `LANE_KINDS`, tried in turn).

Express is one of the worker's answerers (worker/answerers.py), after the hold and before the
full path: whole, RESULT frame and all, on the loop (`answer_on_loop`, `answer_now`), or as a
frame on the compute thread (`answer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from moeswarm.wire.frames import HEADER_SIZE, Frame, Opcode
from moeswarm.wire.layouts import KnownLayouts
from moeswarm.wire.messages import Dispatch
from moeswarm.wire.tensors import located
from moeswarm.worker.hold import Hold

if TYPE_CHECKING:
    from moeswarm.worker.answerers import LoopSide
    from moeswarm.worker.session import Session


class LearnedLane(Protocol):
    """How DISPATCHes with one metadata's bytes are answered without the full path (a lane kind)."""

    tokens: int  # the DISPATCH's tokens
    payload_bytes: int  # its payload's length: a frame of another length is not this lane's
    reply_bytes: int  # the room a whole RESULT frame of it needs (answers_whole)
    answers_whole: bool  # `answer_now` gives whole RESULT frames

    def answer(self, frame: Frame) -> Frame | None:
        """The RESULT for DISPATCH `frame` (its metadata this lane's), or None: refused here, the full
        path answers it and names what is wrong."""

    def answer_now(self, body: bytes, request_id: int) -> memoryview | None:
        """The whole RESULT frame (header, metadata, payload) for the DISPATCH whose frame body is `body`
        (its metadata this lane's, its payload `payload_bytes` long), or None as `answer`."""

    def in_c(self) -> tuple[tuple, bool] | None:
        """(qkernels.express_lane's struct and what it points into, exact) where a held connection
        answers the lane's frames in C; None: by `answer_now` (worker/hold.py)."""


# A lane kind: (store, frame, its decoded DISPATCH, the full path's RESULT, where its tensors lie:
# wire/tensors.py `located`) -> the lane; False: no lane for this metadata; None: not this kind's.
LaneKind = Callable[[object, Frame, Dispatch, Frame, dict], "LearnedLane | bool | None"]


class Express:
    """The lanes a worker has learned, and the answers they give: the express answerer
    (worker/answerers.py), whole on the loop (`answer_on_loop`, `answer_now`) or as a frame on the
    compute thread (`answer`)."""

    name = "express"

    def __init__(self, store, kinds: Sequence[LaneKind]):
        """kinds: the lane kinds, asked in turn for a lane of each new metadata."""
        self.store = store
        self.kinds = tuple(kinds)
        self._lanes: KnownLayouts[LearnedLane | bool] = KnownLayouts()  # False: metadata seen, no lane for it
        self.answered = 0
        self.whole = 0  # of them, answered with the whole RESULT frame on the loop (`answer_now`)
        self.hold = Hold(self.answer_now)  # the lanes answered whole, for a connection held between them (worker/hold.py)

    def answer(self, frame: Frame, sized: bool = False) -> Frame | None:
        """The RESULT for `frame`, or None: not known here (or refused: the full path says why). Its
        metadata bytes passed every check before, whether `sized` or not."""
        lane = self._lanes.get(frame)
        if not lane:
            return None
        reply = lane.answer(frame)
        if reply is not None:
            self.answered += 1
        return reply

    def answer_on_loop(self, loop: LoopSide, session: Session, request_id: int, meta_len: int, body: bytes,
                       feed: Callable[[bytes], None] | None) -> bool:
        """A DISPATCH the connection's reader read (`feed` None; the transport's callback's are the
        hold's) answered whole on the loop: `answer_whole_on_loop`."""
        return feed is None and self.answer_whole_on_loop(loop, session, request_id, meta_len, body)

    def answer_whole_on_loop(self, loop: LoopSide, session: Session, request_id: int, meta_len: int,
                             body: bytes) -> bool:
        """Answer the DISPATCH with this request id and frame body (its metadata the first `meta_len`
        bytes) on the loop, its RESULT sent at once: True; False: it goes the usual way (decoded and
        queued). Its metadata has a whole-RESULT lane: those bytes passed every check before (the
        first frame with them went the full path), so the frame's size fits its limits and its
        RESULT (the size of its rows) the connection's bound. Its header is not made into an object
        (the transport's callback: every small step counts there)."""
        if not session.greeted or not session.can_write_now():
            return False
        lane = self.whole_lane(body, meta_len)
        if lane is None or lane.tokens > loop.inline_tokens:
            return False
        ran, reply = loop.runner.run_now(session, lambda: self.answer_now(lane, body, request_id), lane.tokens)
        if not ran or reply is None:
            return False
        session.slot.last_active = time.monotonic()
        if not session.write_buffers_now([reply], 0):  # a reply got ahead of it meanwhile: in turn
            meta_len = int.from_bytes(reply[16:20], "little")
            payload = reply[HEADER_SIZE + meta_len :]
            loop.in_turn(session, Frame(Opcode.RESULT, request_id, {}, (payload,),
                                        bytes(reply[HEADER_SIZE : HEADER_SIZE + meta_len])))
        return True

    def whole_lane(self, body: bytes, meta_len: int) -> LearnedLane | None:
        """The lane that answers the DISPATCH whose frame body is `body` (its metadata its first
        `meta_len` bytes) with a whole RESULT frame (`answer_now`), found without decoding it."""
        lane = self._lanes.get_bytes(body[:meta_len])
        if not lane or not lane.answers_whole or len(body) - meta_len != lane.payload_bytes:
            return None
        return lane

    def answer_now(self, lane: LearnedLane, body: bytes, request_id: int) -> memoryview | None:
        """The whole RESULT frame (header, metadata, payload) answering the DISPATCH whose frame body is
        `body` (its `whole_lane`); None where the lane declines (the full path then answers it and
        names any fault)."""
        reply = lane.answer_now(body, request_id)
        if reply is not None:
            self.answered += 1
            self.whole += 1
        return reply

    def learn(self, frame: Frame, request: Dispatch, reply: Frame) -> None:
        """Remember how `frame`'s metadata is answered, where a lane kind can answer it: `request` is its
        decoded DISPATCH and `reply` the RESULT the full path gave it."""
        if frame.meta_bytes is None or reply.opcode != Opcode.RESULT or self._lanes.get(frame) is not None:
            return  # learned from answers only (an ERROR may be about the values), once per metadata
        lane = self._lane(frame, request, reply)
        self._lanes.remember(frame, lane)
        if lane and lane.answers_whole:
            self.hold.add(frame.meta_bytes, lane)

    def _lane(self, frame: Frame, request: Dispatch, reply: Frame) -> LearnedLane | bool:
        """The first kind's lane for `frame`'s metadata, or False: float32 DISPATCHes combined in f32 only."""
        if request.wire_combine != "f32" or request.hidden.dtype != torch.float32 \
                or request.top_k_weights.dtype != torch.float32:
            return False
        at = located(frame.meta["tensors"])  # {name: (offset, size, codec, dtype, shape)}
        for kind in self.kinds:
            lane = kind(self.store, frame, request, reply, at)
            if lane is not None:
                return lane
        return False
