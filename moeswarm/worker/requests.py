"""A request frame on the event loop: its immediate reply, or a DISPATCH queued for the compute thread.

PING and HELLO are answered at once. A DISPATCH is checked from its metadata alone (declared
shapes against the limits, the RESULT's size bound against its connection's unsent bound and the
worker's reply budget: worker/replies.py) and queued on the compute runner; its RESULT leaves from
the compute thread itself when nothing is ahead of it on its connection (session.py `write_now`),
else from the loop, in turn. A DISPATCH whose metadata has a whole-RESULT lane is answered on the
loop before anything else (worker/answerers.py `Answerers.on_loop`). A DISPATCH of a few tokens (a decode
step's) that finds the runner idle runs on the loop at once (runner.py `run_here`): no thread
hand-off, no wake-up. Each
frame's byte-budget reservation is given back when its reply is decided (at once, or when its
DISPATCH is done).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeswarm.errors import MoeSwarmError, ProtocolError, printable
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.layouts import KnownLayouts
from moeswarm.wire.messages import ErrorReply, Hello, WorkerInfo
from moeswarm.wire.stream import decode_frame
from moeswarm.worker.answerers import LoopSide
from moeswarm.worker.compute import Computation
from moeswarm.worker.framing import Incoming
from moeswarm.worker.limits import ByteBudget, WorkerLimits, check_dispatch_size, declared_shapes, reply_bound
from moeswarm.worker.merge import merge_key
from moeswarm.worker.replies import AwaitRoom, reply_room
from moeswarm.worker.runner import CANCELLED, ComputeRunner, WorkerBusy

if TYPE_CHECKING:
    from moeswarm.worker.session import Session

log = logging.getLogger("moeswarm.worker")


@dataclass(frozen=True)
class Sized:
    """What a DISPATCH's metadata says of its size, checked against the limits: the same for every
    frame with the same metadata bytes (wire/layouts.py)."""

    owed: int  # bytes its RESULT may take at most
    cost: int  # tokens: the compute thread is shared by them
    merge_key: Hashable | None


class Requests:
    """Answers the frames of every connection of one worker (on its event loop)."""

    def __init__(self, info: WorkerInfo, limits: WorkerLimits, budget: ByteBudget, runner: ComputeRunner,
                 computation: Computation, sessions: Mapping[asyncio.Task, Session], inline_tokens: int = 0):
        """inline_tokens: a DISPATCH of at most this many tokens runs on the loop when the runner is
        idle (0: none does)."""
        self.info = info
        self.limits = limits
        self.budget = budget
        self.runner = runner
        self.computation = computation
        self.sessions = sessions  # every open connection's Session: the reply budget counts them all
        self.inline_tokens = inline_tokens
        self.loop_side = LoopSide(runner, inline_tokens, self._reply_in_turn)  # for the answerers (worker/answerers.py)
        self._sized: KnownLayouts[Sized] = KnownLayouts()

    def handle(self, session: Session, incoming: Incoming) -> Frame | AwaitRoom | None:
        """The immediate reply to one frame, None when a DISPATCH went to the runner, or AwaitRoom
        when it may go once the connection's unsent replies leave room for its RESULT."""
        header, rid = incoming.header, incoming.header.request_id
        handed_over = False
        try:
            if incoming.body is None:
                raise WorkerBusy(self.budget.held, self.budget.limit, "bytes of requests held")
            if header.opcode == Opcode.DISPATCH and self.answer_on_loop(session, rid, header.meta_len, incoming.body):
                return None  # answered on the loop (worker/answerers.py)
            frame = decode_frame(header, incoming.body)
            if frame.opcode == Opcode.PING:
                return Frame(Opcode.PONG, rid)
            if frame.opcode == Opcode.HELLO:
                return self._hello(session, frame)
            if frame.opcode == Opcode.DISPATCH:
                if not session.greeted:
                    raise ProtocolError("DISPATCH before HELLO: send HELLO with the model fingerprint first")
                sized = self._sized.get(frame)  # metadata bytes found within the limits before
                if sized is None:
                    sized = self._size(frame)
                    self._sized.remember(frame, sized)
                owed = sized.owed
                unsent = session.unsent
                handed_over = True  # from here the body's reservation is given back by _submit, or once done
                if unsent and unsent + owed > self.limits.max_unsent_bytes:  # it waits, its body still reserved
                    return AwaitRoom(owed, functools.partial(self._submit, session, incoming, frame, sized))
                return self._submit(session, incoming, frame, sized)
            raise ProtocolError(f"unexpected opcode {frame.opcode.name} from a client")
        except WorkerBusy as busy:
            log.info("request %d refused: %s", rid, busy)
            return ErrorReply("busy", str(busy)).to_frame(rid)
        except MoeSwarmError as error:
            log.info("request %d refused: %s", rid, printable(str(error)))
            return ErrorReply("bad_request", str(error)).to_frame(rid)
        finally:
            if not handed_over:
                self.budget.give(incoming.reserved)

    def answer_on_loop(self, session: Session, request_id: int, meta_len: int, body: bytes,
                       feed: Callable[[bytes], None] | None = None) -> bool:
        """A DISPATCH read whole (its frame body `body`, its metadata the first `meta_len` bytes) answered
        on the loop by the worker's answerers (worker/answerers.py `Answerers.on_loop`; `feed`: the
        connection's reader, where the transport's callback read it): True; False: it goes the usual way."""
        return self.computation.answerers.on_loop(self.loop_side, session, request_id, meta_len, body, feed)

    def _size(self, frame: Frame) -> Sized:
        """A DISPATCH's declared sizes checked against the limits, from its metadata alone."""
        shapes = declared_shapes(frame.meta)
        check_dispatch_size(frame.meta, self.limits, shapes, self.computation.model_top_k)
        # The RESULT's size, counted before the request is queued: a bound from the declared
        # shapes, never over what one connection may hold (a larger exact size is refused
        # on the compute thread before any expert runs).
        owed = min(reply_bound(frame.meta, self.info.hidden_size, self.info.num_experts, shapes),
                   self.limits.max_unsent_bytes)
        shape = shapes.get("x")
        return Sized(owed, shape[0] if shape else 1, merge_key(frame.meta))

    def _submit(self, session: Session, incoming: Incoming, frame: Frame, sized: Sized) -> Frame | None:
        """Queue a DISPATCH whose RESULT (`sized.owed` bytes at most) fits the connection's bound; None
        once queued, else the ERROR that answers it (its body's reservation is then given back)."""
        rid = incoming.header.request_id
        owed, cost = sized.owed, sized.cost
        try:
            reply_room(self.sessions.values(), session, owed, self.limits.max_reply_bytes)
            session.owe(owed)
            session.held_bytes_peak = max(session.held_bytes_peak, owed)
            work = functools.partial(self.computation.one, frame, True)
            done = functools.partial(self._done, session, incoming.reserved, owed, rid)
            try:
                if not (cost <= self.inline_tokens and self.runner.run_here(session, work, cost, done)):
                    self.runner.submit(session, work, cost, sized.merge_key, frame, done=done)
            except BaseException:
                session.settle(owed)
                raise
            session.slot.last_active = time.monotonic()  # a queued DISPATCH is activity; a refused one is not
            return None
        except WorkerBusy as busy:
            self.budget.give(incoming.reserved)
            log.info("request %d refused: %s", rid, busy)
            return ErrorReply("busy", str(busy)).to_frame(rid)
        except BaseException:
            self.budget.give(incoming.reserved)
            raise

    def _hello(self, session: Session, frame: Frame) -> Frame:
        first = not session.greeted  # only the first HELLO is activity: another one renews nothing
        session.greeted = False
        hello = Hello.from_frame(frame)
        if hello.fingerprint != self.info.fingerprint:
            raise ProtocolError(
                f"model fingerprint mismatch: this worker serves {self.info.model_type} model "
                f"{self.info.fingerprint}, the backbone runs {hello.fingerprint}"
            )
        session.greeted = session.slot.greeted = True
        if first:
            session.slot.last_active = time.monotonic()
        return self.info.to_frame(frame.request_id)

    def _done(self, session: Session, reserved: int, owed: int, rid: int, reply: Frame | None,
              error: BaseException | None) -> None:
        """A DISPATCH's outcome (on the compute thread; on the loop for one dropped unrun): its RESULT
        leaves from here when nothing is ahead of it, else the loop sends it in turn."""
        self.budget.give(reserved)  # the request's body is no longer held
        if error is CANCELLED:
            session.settle(owed)
            return
        if error is not None:  # a bug on our side (Computation answers every request itself): say so, keep serving
            log.error("request %d failed: %s", rid, printable(repr(error)))
            reply = ErrorReply("internal", printable(f"{type(error).__name__}: {error}")).to_frame(rid)
        if not session.write_now(reply, owed):
            try:
                session.loop.call_soon_threadsafe(self._reply_in_turn, session, reply)
            except RuntimeError:  # the loop is closed: the worker is stopping
                pass

    def _reply_in_turn(self, session: Session, reply: Frame) -> None:
        if not session.closed:
            session.track(asyncio.create_task(self._send_reply(session, reply)))

    async def _send_reply(self, session: Session, reply: Frame) -> None:
        try:
            await session.send(reply, self.limits.idle_timeout_s, queued=True)
        except asyncio.TimeoutError:
            log.warning("closing connection from %s: replies not read for %g s", session.peer,
                        self.limits.idle_timeout_s)
            session.writer.transport.abort()
        except (ConnectionError, OSError) as error:
            log.info("reply to %s lost: %s", session.peer, printable(str(error)))
