"""The worker's answerers: the ways a DISPATCH is answered, one chain, behind one interface.

A DISPATCH is answered one of three ways, each with the same bits (tests/test_call_paths.py):

- hold (worker/hold.py `HeldConnection`): a DISPATCH read whole by the transport's callback is
  answered whole by express, then the connection is held on the loop's thread for its next frames:
  those of a learned lane are read, answered and sent in C by express's lanes (worker/hold.py `Hold`);
- express (worker/express_answer.py `Express`): a frame whose metadata bytes the full path answered
  before, answered from its bytes by the lane learned for them (`LANE_KINDS`: quantized experts in
  one C call, float ones by the store's own run or module); whole, RESULT frame and all, on the
  loop, or as a frame on the compute thread;
- compute (worker/compute.py `Computation`): the full path on the compute thread: decode, check,
  the store's run (merged with other connections' DISPATCHes where it may), encode. It answers
  every frame, and teaches express the lanes it may answer next time (`Express.learn`).

Every answerer is an `Answerer`, and `Answerers` (made by `answerers`, the one place the chain and
the lane kinds are chosen) asks them in turn wherever a DISPATCH is:

- on the loop (`Answerers.on_loop`), for a DISPATCH read whole (by the transport's callback,
  worker/server.py `_whole_frame`, or the connection's reader, worker/requests.py `handle`), when
  nothing computes and nothing is ahead of it on its connection; if none answers it there, the frame
  is decoded and queued (worker/requests.py), and
- on the compute thread (`Answerers.one`), until one answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from moeswarm.wire.frames import Frame
from moeswarm.worker.express_answer import Express, LaneKind
from moeswarm.worker.hold import HeldConnection
from moeswarm.worker.quant_lane import learn_quant_lane
from moeswarm.worker.torch_lane import learn_torch_lane

if TYPE_CHECKING:
    from moeswarm.worker.runner import ComputeRunner
    from moeswarm.worker.session import Session

# express's lane kinds, asked in turn for each new metadata: the first that knows the layer's experts
LANE_KINDS: tuple[LaneKind, ...] = (learn_quant_lane, learn_torch_lane)


@dataclass(frozen=True)
class LoopSide:
    """What an answer on the event loop needs of the worker's loop side (worker/requests.py)."""

    runner: ComputeRunner  # the answer runs as its work (`run_now`): nothing else computes meanwhile
    inline_tokens: int  # the most tokens a DISPATCH answered on the loop may have (0: none)
    in_turn: Callable[[Session, Frame], None]  # sends a reply on the loop after the ones ahead of it


class Answerer(Protocol):
    """One way a DISPATCH is answered (hold, express, compute)."""

    name: str

    def answer_on_loop(self, loop: LoopSide, session: Session, request_id: int, meta_len: int, body: bytes,
                       feed: Callable[[bytes], None] | None) -> bool:
        """Answer on the event loop the DISPATCH with this request id whose frame body is `body` (its
        metadata the first `meta_len` bytes, its header not made into an object), its reply sent:
        True; False: not this answerer's here. feed: the connection's reader, where the frame came
        whole in the transport's callback (None: read by the reader)."""

    def answer(self, frame: Frame, sized: bool = False) -> Frame | None:
        """On the compute thread: the reply to DISPATCH `frame` (a RESULT, or an ERROR naming what is
        wrong), or None: not this answerer's, the next one answers it. sized: the frame's declared
        sizes were checked already."""


class Answerers:
    """The worker's answerers, asked in turn."""

    def __init__(self, chain: tuple[Answerer, ...]):
        self.chain = chain

    def on_loop(self, loop: LoopSide, session: Session, request_id: int, meta_len: int, body: bytes,
                feed: Callable[[bytes], None] | None = None) -> bool:
        """The first answerer's answer on the loop (`Answerer.answer_on_loop`): True; False where none
        answers it there (it goes the usual way: decoded and queued)."""
        for answerer in self.chain:
            if answerer.answer_on_loop(loop, session, request_id, meta_len, body, feed):
                return True
        return False

    def one(self, frame: Frame, sized: bool = False) -> Frame:
        """The first answerer's reply to DISPATCH `frame` on the compute thread (the full path answers
        every one)."""
        for answerer in self.chain:
            reply = answerer.answer(frame, sized)
            if reply is not None:
                return reply
        raise AssertionError("the full path answers every DISPATCH")


def answerers(store, compute: Answerer) -> tuple[Answerers, Express]:
    """The chain, hold, express (with `LANE_KINDS`) and `compute` (the full path, last), and its express
    (the full path teaches it its lanes)."""
    express = Express(store, LANE_KINDS)
    return Answerers((HeldConnection(express), express, compute)), express
