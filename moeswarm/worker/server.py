"""The worker's asyncio TCP server: one persistent connection per backbone.

The event loop reads frames (worker/framing.py) and answers PING and HELLO at once; the experts
run on the compute runner's thread (runner.py), which also decodes each DISPATCH's tensors,
encodes its RESULT and, on a plain TCP connection with nothing ahead of it, sends it itself
(session.py): a one-token layer call wakes the loop once, for its request, not again for its
reply. So a PING is answered while experts compute, also on the connection whose DISPATCH is
running: a PONG may overtake a RESULT (replies carry their request id). RESULTs of one
connection leave in the order of its DISPATCHes.

Everything the network sends is bounded before use (worker/limits.py, docs/protocol.md
"Limits"): connections (a TLS handshake in progress included, per peer address too; a quiet one
makes room for a newcomer when full: worker/admission.py), frame sizes (smaller before HELLO),
tokens and top-k per DISPATCH (top-k at most the model's), requests queued per connection and in
total, bytes of request bodies held, each RESULT's size counted against its connection's bound
and the worker's reply budget before it is computed (worker/replies.py), and the time a frame,
a HELLO (from accept) or an idle connection (from its last DISPATCH) may take, or a client may
leave its replies untaken.

A bad frame gets an ERROR reply and the worker goes on serving. When the framing itself is
broken (bad magic or version, a length over the limit, a truncated header or body, a frame that
does not arrive in time) the stream cannot be trusted past that point: the worker replies ERROR
and closes that one connection, never the server. A connection that closes loses its DISPATCHes
that had not started, and the memory its requests and replies held is released.

ERROR codes: "bad_request" (the request broke the protocol or asked for what this worker does
not serve), "busy" (a limit is full: retry later; also the answer to a connection over the
limit, which is then closed), "framing" and "truncated" (the connection closes after them),
"timeout" (no HELLO, or no frame, in time: the connection closes), "internal" (a bug in the
worker). Peer text is escaped (`printable`) before it reaches the log.
"""

from __future__ import annotations

import asyncio
import ssl
import functools
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from moeswarm.errors import MoeSwarmError, ProtocolError, printable
from moeswarm.wire.codecs import CODECS
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result, WorkerInfo
from moeswarm.wire.stream import decode_frame
from moeswarm.worker.admission import (ConnectionTable, CountedLog, Slot, StreamProtocol, handshake, loop_errors,
                                       peer_host)
from moeswarm.worker.framing import FrameFault, Idle, Incoming, read_frame
from moeswarm.worker.limits import (ByteBudget, WorkerLimits, check_dispatch_size, check_reply_size, declared_shapes,
                                    reply_bound)
from moeswarm.worker.replies import AwaitRoom, check_reply_bytes, reply_room, watch_replies
from moeswarm.worker.memory import release_freed_memory
from moeswarm.worker.merge import merge, merge_key, partners, split
from moeswarm.worker.runner import CANCELLED, DECLINED, ComputeRunner, WorkerBusy
from moeswarm.worker.session import Session

if TYPE_CHECKING:
    from moeswarm.worker.store import ExpertStore

log = logging.getLogger("moeswarm.worker")


class WorkerServer:
    """Serve `store`'s experts to backbones running the model with `fingerprint`.

    store: an ExpertStore, or anything with its `num_experts`, `hidden_size`, `held`
    ({layer: experts}) and `run(Dispatch) -> Result` (called on the compute thread only, one call
    at a time).
    limits: what the worker accepts and how long it waits (WorkerLimits' defaults when None).
    top_k: the model's router top-k (`limits.model_top_k(config)`): no DISPATCH may ask for more.
    """

    def __init__(self, store: ExpertStore, fingerprint: str, model_type: str, limits: WorkerLimits | None = None,
                 tls: ssl.SSLContext | None = None, top_k: int | None = None):
        self.store = store
        self.model_top_k = top_k
        self.tls = tls  # the swarm key's context (transport/tls.py); None: plain TCP
        self.fingerprint = fingerprint
        self.info = WorkerInfo(fingerprint, model_type, store.num_experts, store.hidden_size, store.held,
                               tuple(sorted(CODECS)))
        self.limits = limits or WorkerLimits()
        self.budget = ByteBudget(self.limits.max_buffered_bytes)
        # DISPATCHes of one layer from several connections may run as one expert call (worker/merge.py)
        self.runner = ComputeRunner(self.limits.queue_limit, owner_limit=self.limits.queue_per_connection,
                                    batch_work=self.compute_batch, batch_cost=self.limits.max_tokens)
        self._server: asyncio.base_events.Server | None = None
        self._sessions: dict[asyncio.Task, Session] = {}
        self._handshakes: dict[asyncio.Task, asyncio.StreamWriter] = {}  # accepted, TLS handshake under way
        self.table = ConnectionTable(self.limits.max_connections, self.limits.max_connections_per_peer,
                                     self.limits.evict_after_s)
        self.refusals = CountedLog(log, "connections refused")
        self.failures = CountedLog(log, "connections failed before a session began")  # accept, TLS handshake
        self._watch: asyncio.Task | None = None
        self._closing = False
        self.merged_calls = 0  # expert calls that served several connections' DISPATCHes at once
        self.merged_requests = 0  # the DISPATCHes they served

    @property
    def connections(self) -> int:
        """Connections holding a slot: sessions and TLS handshakes under way."""
        return len(self.table)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen and start the compute thread; return the bound (host, port).

        TLS runs inside each connection's slot (`_serve`), not in asyncio's accept path: a handshake
        in progress counts toward --max-connections and is bounded by the HELLO deadline."""
        self.runner.start()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(functools.partial(loop_errors, self.failures, loop.get_exception_handler()))
        tls = self.tls is not None

        def protocol() -> asyncio.StreamReaderProtocol:
            return StreamProtocol(asyncio.StreamReader(limit=2**16, loop=loop), self._serve, loop=loop, paused=tls)

        self._server = await loop.create_server(protocol, host, port, backlog=min(self.limits.max_connections, 4096))
        self._watch = asyncio.create_task(watch_replies(self._sessions, self.limits.frame_timeout_s,
                                                         (self.failures, self.refusals)))
        return self._server.sockets[0].getsockname()[:2]

    async def serve_socket(self, sock: socket.socket) -> None:
        """Serve a connection this worker opened itself (a relay's pipe, relay/worker.py) as if
        it had accepted it: TLS server side with the swarm key, then the same session as any other.
        Returns once the session is started (after the TLS handshake); raises if the handshake fails."""
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), self._serve, loop=loop)

        handshake = {"ssl": self.tls, "ssl_handshake_timeout": self.limits.hello_timeout_s} if self.tls else {}
        await loop.connect_accepted_socket(protocol, sock, **handshake)

    async def serve_forever(self) -> None:
        """Serve until cancelled; then close everything (the cancellation propagates, quietly)."""
        assert self._server is not None, "start() first"
        try:
            await self._server.serve_forever()
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop listening, end every connection, stop the compute thread after its current job."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        if self._watch is not None:
            self._watch.cancel()
        for writer in self._handshakes.values():
            writer.transport.abort()
        for session in self._sessions.values():
            session.shut()  # before the runner stops: a job that ends after this sends nothing
        # The thread's join is under way before the first await: a second cancellation (asyncio.run
        # cancels every task again on its way out) cannot skip it.
        stopped = self.runner.stop()
        sessions = [task for task in [*self._sessions, *self._handshakes] if task is not asyncio.current_task()]
        for task in sessions:
            # Cancelling alone is not enough on Python 3.11: asyncio.wait_for swallows a cancellation
            # that meets a completed read (gh-86296), and the session would wait for its next frame.
            # The flag and the closed transport end it either way.
            if task in self._sessions:
                self._sessions[task].writer.transport.abort()
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
        await asyncio.shield(stopped)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        admitted = self.table.admit(peer_host(writer))
        if isinstance(admitted, str):
            self._refuse(writer, admitted)
            return
        slot, task = admitted, asyncio.current_task()
        try:
            if self.tls is not None and writer.get_extra_info("sslcontext") is None:
                self._handshakes[task] = writer
                slot.evict = lambda _message: writer.transport.abort()
                try:
                    if not await handshake(writer, self.tls, self.limits.hello_timeout_s, self.failures):
                        return
                finally:
                    self._handshakes.pop(task, None)
            await self._session(reader, writer, slot, task)
        except asyncio.CancelledError:
            pass  # the server is closing (see below)
        finally:
            self.table.release(slot)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot,
                       task: asyncio.Task) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = Session(writer, self.limits.max_unsent_bytes)
        session.slot, session.opened = slot, slot.opened  # the HELLO deadline runs from accept, TLS handshake included
        slot.busy = lambda: session.unsent > 0
        slot.evict = functools.partial(self._evict, session)
        self._sessions[task] = session
        try:
            while not self._closing and await self._next_frame(reader, session):
                pass
        except (ConnectionError, OSError) as error:
            log.info("connection from %s ended: %s", session.peer, printable(str(error)))
        except asyncio.CancelledError:
            # The server is closing. End quietly: asyncio (3.11) logs a traceback for a
            # connection callback that ends cancelled, and nobody awaits this task.
            pass
        finally:
            self._sessions.pop(task, None)
            dropped = self.runner.drop(session)
            if dropped:
                log.info("connection from %s closed with %d requests queued: dropped", session.peer, dropped)
            session.end()
            if session.held_bytes_peak > self.limits.hello_max_bytes:
                release_freed_memory()  # glibc keeps freed arenas otherwise: give the big buffers back

    def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        """One connection over a limit: a short ERROR (plain TCP; a TLS peer just sees the close) and
        close, nothing read, nothing allocated."""
        message = f"worker busy: {why}"
        self.refusals.note("over the per-address limit" if "your address" in why else "over --max-connections")
        if self.tls is None:
            writer.writelines(ErrorReply("busy", message).to_frame(0).encode())
            writer.close()
        else:
            writer.transport.abort()

    def _evict(self, session: Session, message: str) -> None:
        """Close a quiet connection to give its slot to a newcomer (ConnectionTable decided)."""
        log.info("closing connection from %s: %s", session.peer, message)
        session.post(ErrorReply("timeout", message).to_frame(0))
        session.writer.close()

    async def _next_frame(self, reader: asyncio.StreamReader, session: Session) -> bool:
        """Read and handle one frame; False when the connection is to close."""
        limits = self.limits
        try:
            await session.wait_for_room(limits.idle_timeout_s)
        except asyncio.TimeoutError:
            return self._fail(session, 0, "timeout", f"replies not read for {limits.idle_timeout_s:g} s: closing")
        if session.greeted:  # from the last HELLO or DISPATCH: PINGs do not keep a connection open
            wait_s = session.slot.last_active + limits.idle_timeout_s - time.monotonic()
        else:
            wait_s = session.opened + limits.hello_timeout_s - time.monotonic()
        try:
            incoming = await read_frame(reader, limits, self.budget, session.greeted, max(wait_s, 0.0))
        except Idle:
            if session.greeted:
                return self._fail(session, 0, "timeout", f"no DISPATCH for {limits.idle_timeout_s:g} s (PINGs do not count): closing")
            return self._fail(session, 0, "timeout", f"no HELLO within {limits.hello_timeout_s:g} s: closing")
        except FrameFault as fault:
            return self._fail(session, fault.request_id, fault.code, str(fault))
        if incoming is None:  # clean end of stream
            return False
        session.held_bytes_peak = max(session.held_bytes_peak, incoming.reserved)
        reply = self._handle(session, incoming)
        if type(reply) is AwaitRoom:  # the connection's unsent replies leave no room for this one yet
            try:
                await session.wait_for_room(limits.idle_timeout_s, need=reply.owed)
            except asyncio.TimeoutError:
                self.budget.give(incoming.reserved)
                return self._fail(session, 0, "timeout", f"replies not read for {limits.idle_timeout_s:g} s: closing")
            except BaseException:  # cancelled: the server closes
                self.budget.give(incoming.reserved)
                raise
            if session.writer.transport.is_closing():
                self.budget.give(incoming.reserved)
                return False
            reply = reply.submit()
        if reply is not None:
            try:
                await session.send(reply, limits.idle_timeout_s)
            except asyncio.TimeoutError:
                return self._fail(session, 0, "timeout", f"replies not read for {limits.idle_timeout_s:g} s: closing")
        return True

    def _handle(self, session: Session, incoming: Incoming) -> Frame | AwaitRoom | None:
        """The immediate reply to one frame, None when a DISPATCH went to the runner, or AwaitRoom
        when it may go once the connection's unsent replies leave room for its RESULT.

        The frame's budget reservation is given back here, or when its DISPATCH is done.
        """
        header, rid = incoming.header, incoming.header.request_id
        handed_over = False
        try:
            if incoming.body is None:
                raise WorkerBusy(self.budget.held, self.budget.limit, "bytes of requests held")
            frame = decode_frame(header, incoming.body)
            if frame.opcode == Opcode.PING:
                return Frame(Opcode.PONG, rid)
            if frame.opcode == Opcode.HELLO:
                return self._hello(session, frame)
            if frame.opcode == Opcode.DISPATCH:
                if not session.greeted:
                    raise ProtocolError("DISPATCH before HELLO: send HELLO with the model fingerprint first")
                shapes = declared_shapes(frame.meta)
                check_dispatch_size(frame.meta, self.limits, shapes, self.model_top_k)
                # The RESULT's size, counted before the request is queued: a bound from the declared
                # shapes, never over what one connection may hold (a larger exact size is refused
                # on the compute thread before any expert runs).
                owed = min(reply_bound(frame.meta, self.store.hidden_size, self.store.num_experts, shapes),
                           self.limits.max_unsent_bytes)
                unsent = session.unsent
                if unsent and unsent + owed > self.limits.max_unsent_bytes:
                    handed_over = True  # the body stays reserved while it waits
                    return AwaitRoom(owed, functools.partial(self._submit, session, incoming, frame, shapes, owed))
                handed_over = True
                return self._submit(session, incoming, frame, shapes, owed)
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

    def _submit(self, session: Session, incoming: Incoming, frame: Frame, shapes: dict, owed: int) -> Frame | None:
        """Queue a DISPATCH whose RESULT (`owed` bytes at most) fits the connection's bound; None once
        queued, else the ERROR that answers it (its body's reservation is then given back)."""
        rid = incoming.header.request_id
        try:
            reply_room(self._sessions.values(), session, owed, self.limits.max_reply_bytes)
            shape = shapes.get("x")
            cost = shape[0] if shape else 1  # tokens: the compute thread is shared by them
            session.owe(owed)
            session.held_bytes_peak = max(session.held_bytes_peak, owed)
            try:
                self.runner.submit(session, functools.partial(self.compute, frame, True), cost, merge_key(frame.meta),
                                   frame, done=functools.partial(self._done, session, incoming.reserved, owed, rid))
            except BaseException:
                session.owe(-owed)
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
        if hello.fingerprint != self.fingerprint:
            raise ProtocolError(
                f"model fingerprint mismatch: this worker serves {self.info.model_type} model "
                f"{self.fingerprint}, the backbone runs {hello.fingerprint}"
            )
        session.greeted = session.slot.greeted = True
        if first:
            session.slot.last_active = time.monotonic()
        return self.info.to_frame(frame.request_id)

    def compute(self, frame: Frame, sized: bool = False) -> Frame:
        """DISPATCH in, RESULT or ERROR out: decoding, experts and encoding, on the compute thread.

        Also the fuzzer's oracle (moeswarm/tools/bench/fuzz.py): the same checks and maths, run locally.
        sized: the frame's declared sizes were checked against the limits already (`_handle` does).
        """
        decoded = self._decode(frame, sized=sized)
        if isinstance(decoded, Frame):
            return decoded
        return self._answer(frame.request_id, *decoded, self.store.run)

    def compute_batch(self, frames: list[Frame]) -> list[Frame | object]:
        """The runner's batch_work: frames[0]'s DISPATCH and those of other connections that may run
        in one expert call with it (worker/merge.py: same layer and mode, disjoint experts), each
        answered exactly as `compute` would have; DECLINED for the others (they wait their turn)."""
        lead = self._decode(frames[0], sized=True)  # every frame the runner holds passed check_dispatch_size
        if isinstance(lead, Frame):
            return [lead] + [DECLINED] * (len(frames) - 1)
        requests = [(0, lead)]
        for position, frame in enumerate(frames[1:], 1):
            decoded = self._decode(frame, quiet=True, sized=True)
            if not isinstance(decoded, Frame):  # a bad one is declined: it gets its ERROR in its turn
                requests.append((position, decoded))
        chosen = [requests[i] for i in partners([request for _, (request, _) in requests])]
        replies: list[Frame | object] = [DECLINED] * len(frames)
        results = self._merged([request for _, (request, _) in chosen]) if len(chosen) > 1 else None
        if results is None:
            replies[0] = self._answer(frames[0].request_id, *lead, self.store.run)
            return replies
        for (position, decoded), result in zip(chosen, results):
            replies[position] = self._answer(frames[position].request_id, *decoded, lambda _request, r=result: r)
        return replies

    def _merged(self, requests: list[Dispatch]) -> list[Result] | None:
        """Each request's Result from one expert call; None when the merged call is refused (one of
        them asks for what this worker does not serve): then the lead runs alone, the others in their turn."""
        merged, plan = merge(requests)
        try:
            results = split(self.store.run(merged), plan)
        except MoeSwarmError:
            return None
        self.merged_calls += 1
        self.merged_requests += len(requests)
        return results

    def _decode(self, frame: Frame, quiet: bool = False, sized: bool = False) -> tuple[Dispatch, int] | Frame:
        """(the DISPATCH in `frame`, its routed pairs S), or the ERROR frame that answers it (not logged
        when `quiet`). sized: its declared sizes were checked against the limits already (on the loop,
        before queueing)."""
        try:
            if not sized:
                check_dispatch_size(frame.meta, self.limits, model_top_k=self.model_top_k)
            request = Dispatch.from_frame(frame)
            return request, check_reply_bytes(request, self.store.hidden_size, self.store.num_experts,
                                              self.limits.max_unsent_bytes)
        except MoeSwarmError as error:
            if quiet:
                return ErrorReply("bad_request", str(error)).to_frame(frame.request_id)
            log.info("request %d refused: %s", frame.request_id, printable(str(error)))
            return ErrorReply("bad_request", str(error)).to_frame(frame.request_id)
        except Exception as error:  # a bug on our side: report it and keep serving
            log.exception("request %d failed", frame.request_id)
            return ErrorReply("internal", printable(f"{type(error).__name__}: {error}")).to_frame(frame.request_id)

    def _answer(self, rid: int, request: Dispatch, routed: int, run: Callable[[Dispatch], Result]) -> Frame:
        """RESULT (or ERROR) frame for `request` (`routed`: its S), whose Result `run` gives."""
        try:
            result = run(request)
            check_reply_size(routed, request.hidden.shape[0], self.store.hidden_size,
                             request.mode == CombineMode.EXACT, result.outputs)
            return result.to_frame(rid)
        except MoeSwarmError as error:
            log.info("request %d refused: %s", rid, printable(str(error)))
            return ErrorReply("bad_request", str(error)).to_frame(rid)
        except Exception as error:  # a bug on our side: report it and keep serving
            log.exception("request %d failed", rid)
            return ErrorReply("internal", printable(f"{type(error).__name__}: {error}")).to_frame(rid)

    def _done(self, session: Session, reserved: int, owed: int, rid: int, reply: Frame | None,
              error: BaseException | None) -> None:
        """A DISPATCH's outcome (on the compute thread; on the loop for one dropped unrun): its RESULT
        leaves from here when nothing is ahead of it, else the loop sends it in turn."""
        self.budget.give(reserved)  # the request's body is no longer held
        if error is CANCELLED:
            session.owe(-owed)
            return
        if error is not None:  # a bug on our side (compute answers every request itself): say so, keep serving
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

    def _fail(self, session: Session, rid: int, code: str, message: str) -> bool:
        """Answer a framing error or a timeout; the connection closes after it (returns False)."""
        log.warning("closing connection from %s: %s", session.peer, printable(message))
        session.post(ErrorReply(code, message).to_frame(rid))
        return False
