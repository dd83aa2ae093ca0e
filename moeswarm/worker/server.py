"""The worker's asyncio TCP server: one persistent connection per backbone.

The event loop reads frames (worker/framing.py) and answers PING and HELLO at once
(worker/requests.py); the experts run on the compute runner's thread (runner.py), which also
decodes each DISPATCH's tensors and encodes its RESULT (compute.py) and, on a plain TCP
connection with nothing ahead of it, sends it itself (session.py): a one-token layer call wakes
the loop once, for its request, not again for its reply. A PING is answered while experts compute
on the thread, also on the connection whose DISPATCH is running: a PONG may overtake a RESULT
(replies carry their request id). A DISPATCH of at most `inline_tokens` tokens that finds the
thread idle runs on the loop itself (no hand-off; `moeswarm worker --inline-tokens`): frames
arriving meanwhile wait in the socket for the few ms it takes. RESULTs of one
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
from typing import TYPE_CHECKING

from moeswarm.errors import printable
from moeswarm.kernels import qkernels
from moeswarm.wire.codecs import CODECS
from moeswarm.wire.frames import HEADER, HEADER_SIZE, MAGIC, VERSION, Opcode
from moeswarm.wire.messages import ErrorReply, WorkerInfo
from moeswarm.worker.admission import (ConnectionTable, CountedLog, Slot, StreamProtocol, handshake, loop_errors,
                                       peer_host)
from moeswarm.worker.compute import Computation
from moeswarm.worker.framing import FrameFault, Idle, IdleWatch, buffered, read_frame
from moeswarm.worker.limits import ByteBudget, WorkerLimits
from moeswarm.worker.memory import release_freed_memory
from moeswarm.worker.replies import AwaitRoom, watch_replies
from moeswarm.worker.requests import Requests
from moeswarm.worker.runner import ComputeRunner
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
    inline_tokens: a DISPATCH of at most this many tokens runs on the event loop when the compute
    thread is idle (worker/runner.py `run_here`); 0: every one runs on the thread (a store whose
    `run` may block for long, as tests' gated stores do, must keep 0).
    """

    def __init__(self, store: ExpertStore, fingerprint: str, model_type: str, limits: WorkerLimits | None = None,
                 tls: ssl.SSLContext | None = None, top_k: int | None = None, inline_tokens: int = 0):
        self.store = store
        self.tls = tls  # the swarm key's context (transport/tls.py); None: plain TCP
        self.fingerprint = fingerprint
        self.limits = limits or WorkerLimits()
        self.info = WorkerInfo(fingerprint, model_type, store.num_experts, store.hidden_size, store.held,
                               tuple(sorted(CODECS)), self.limits.max_unsent_bytes)  # the backbone splits by it
        self.budget = ByteBudget(self.limits.max_buffered_bytes)
        self.computation = Computation(store, self.limits, top_k)  # the compute thread's side
        # DISPATCHes of one layer from several connections may run as one expert call (worker/merge.py)
        self.runner = ComputeRunner(self.limits.queue_limit, owner_limit=self.limits.queue_per_connection,
                                    batch_work=self.computation.batch, batch_cost=self.limits.max_tokens,
                                    on_idle=qkernels.rest)
        self._server: asyncio.base_events.Server | None = None
        self._sessions: dict[asyncio.Task, Session] = {}
        self.requests = Requests(self.info, self.limits, self.budget, self.runner, self.computation, self._sessions,
                                 inline_tokens)
        self._handshakes: dict[asyncio.Task, asyncio.StreamWriter] = {}  # accepted, TLS handshake under way
        self.table = ConnectionTable(self.limits.max_connections, self.limits.max_connections_per_peer,
                                     self.limits.evict_after_s)
        self.refusals = CountedLog(log, "connections refused")
        self.failures = CountedLog(log, "connections failed before a session began")  # accept, TLS handshake
        self._watch: asyncio.Task | None = None
        self._closing = False

    @property
    def merged_calls(self) -> int:
        """Expert calls that served several connections' DISPATCHes at once."""
        return self.computation.merged_calls

    @property
    def merged_requests(self) -> int:
        """The DISPATCHes those merged calls served."""
        return self.computation.merged_requests

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
                                                         (self.failures, self.refusals), self.tls))
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
        watch = IdleWatch()
        protocol = writer.transport.get_protocol()
        if isinstance(protocol, StreamProtocol):
            protocol.take_whole = functools.partial(self._whole_frame, reader, session, watch)
        try:
            while not self._closing and await self._next_frame(reader, session, watch):
                pass
        except (ConnectionError, OSError) as error:
            log.info("connection from %s ended: %s", session.peer, printable(str(error)))
        except asyncio.CancelledError:
            # The server is closing. End quietly: asyncio (3.11) logs a traceback for a
            # connection callback that ends cancelled, and nobody awaits this task.
            pass
        finally:
            if isinstance(protocol, StreamProtocol):
                protocol.take_whole = None
            watch.close()
            self._sessions.pop(task, None)
            dropped = self.runner.drop(session)
            if dropped:
                log.info("connection from %s closed with %d requests queued: dropped", session.peer, dropped)
            session.end()
            if session.held_bytes_peak > self.limits.hello_max_bytes:
                release_freed_memory()  # glibc keeps freed arenas otherwise: give the big buffers back

    def _whole_frame(self, reader: asyncio.StreamReader, session: Session, watch: IdleWatch, data: bytes) -> bool:
        """A chunk the transport read that is one whole DISPATCH frame, while the connection's reader
        waits between frames with nothing buffered: answered here, in the transport's callback, when
        its metadata has a whole-RESULT lane (worker/answerers.py `Answerers.on_loop`), and the reader never
        sees it: a decode step's DISPATCH then costs no wake-up of the reader's coroutine and none of
        its steps. False: the reader gets the chunk as usual (and every check of its own)."""
        if self._closing or not watch.waiting or buffered(reader) or len(data) < HEADER_SIZE:
            return False
        magic, version, opcode, _, request_id, meta_len, payload_len = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or opcode != Opcode.DISPATCH \
                or HEADER_SIZE + meta_len + payload_len != len(data):
            return False  # the reader's own checks name anything wrong
        # answered on the loop, and the connection held for its next frames (worker/answerers.py)
        if not self.requests.answer_on_loop(session, request_id, meta_len, data[HEADER_SIZE:], reader.feed_data):
            return False
        watch.renew(self.limits.idle_timeout_s)
        return True

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

    async def _next_frame(self, reader: asyncio.StreamReader, session: Session, watch: IdleWatch) -> bool:
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
            incoming = await read_frame(reader, limits, self.budget, session.greeted, max(wait_s, 0.0), watch)
        except Idle:
            if session.greeted:
                return self._fail(session, 0, "timeout", f"no DISPATCH for {limits.idle_timeout_s:g} s (PINGs do not count): closing")
            return self._fail(session, 0, "timeout", f"no HELLO within {limits.hello_timeout_s:g} s: closing")
        except FrameFault as fault:
            return self._fail(session, fault.request_id, fault.code, str(fault))
        if incoming is None:  # clean end of stream
            return False
        session.held_bytes_peak = max(session.held_bytes_peak, incoming.reserved)
        reply = self.requests.handle(session, incoming)
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

    def _fail(self, session: Session, rid: int, code: str, message: str) -> bool:
        """Answer a framing error or a timeout; the connection closes after it (returns False)."""
        log.warning("closing connection from %s: %s", session.peer, printable(message))
        session.post(ErrorReply(code, message).to_frame(rid))
        return False
