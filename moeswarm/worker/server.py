"""The worker's asyncio TCP server: one persistent connection per backbone.

The event loop reads frames (through `moeswarm.wire.stream`), answers PING and HELLO at once and
writes every reply; the experts run on the compute runner's thread (runner.py), which also
decodes each DISPATCH's tensors and encodes its RESULT. So a PING is answered while experts
compute, also on the connection whose DISPATCH is running: a PONG may overtake a RESULT (replies
carry their request id). RESULTs of one connection leave in the order of its DISPATCHes.

A bad frame gets an ERROR reply and the worker goes on serving. When the framing itself is
broken (bad magic or version, a length over the limit, a truncated header or body, a body that
does not arrive in time) the stream cannot be trusted past that point: the worker replies ERROR
and closes that one connection, never the server. When the runner's queue is full a DISPATCH is
answered at once with ERROR code "busy". A connection that closes loses its DISPATCHes that had
not started.

ERROR codes: "bad_request" (the request broke the protocol or asked for what this worker does
not serve), "busy" (retry later), "framing" and "truncated" (the connection closes after them),
"internal" (a bug in the worker).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from typing import TYPE_CHECKING

from moeswarm.errors import MoeSwarmError, ProtocolError
from moeswarm.wire.codecs import CODECS
from moeswarm.wire.frames import DEFAULT_MAX_PAYLOAD_BYTES, HEADER_SIZE, Frame, Header, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, WorkerInfo
from moeswarm.wire.stream import StreamClosed, decode_frame, read_body, read_header, write_frame
from moeswarm.worker.runner import DEFAULT_QUEUE_LIMIT, ComputeRunner, WorkerBusy

if TYPE_CHECKING:
    from moeswarm.worker.store import ExpertStore

log = logging.getLogger("moeswarm.worker")
BODY_TIMEOUT_S = 30.0  # a header promised this body: a peer that stalls mid-frame is cut off


class _Session:
    """One connection's state: whether HELLO succeeded, its writer, and its pending RESULT tasks."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.peer = writer.get_extra_info("peername")
        self.greeted = False
        # Replies are written by several tasks (the reader, one per RESULT): one frame at a time,
        # and in FIFO order, which keeps one connection's RESULTs in the order they were computed.
        self._write_lock = asyncio.Lock()
        self.replies: set[asyncio.Task] = set()

    async def send(self, frame: Frame) -> None:
        async with self._write_lock:
            await write_frame(self.writer, frame)

    def track(self, task: asyncio.Task) -> None:
        self.replies.add(task)
        task.add_done_callback(self.replies.discard)


class WorkerServer:
    """Serve `store`'s experts to backbones running the model with `fingerprint`.

    store: an ExpertStore, or anything with its `num_experts`, `hidden_size`, `held`
    ({layer: experts}) and `run(Dispatch) -> Result` (called on the compute thread only, one call
    at a time).
    queue_limit: DISPATCHes that may wait for the compute thread, over all connections (each holds
    its body, so at most queue_limit * max_payload bytes wait).
    body_timeout_s: how long a frame's body may take to arrive once its header has.
    """

    def __init__(self, store: ExpertStore, fingerprint: str, model_type: str,
                 max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES, *, queue_limit: int = DEFAULT_QUEUE_LIMIT,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        self.store = store
        self.fingerprint = fingerprint
        self.info = WorkerInfo(fingerprint, model_type, store.num_experts, store.hidden_size, store.held,
                               tuple(sorted(CODECS)))
        self.max_payload = max_payload
        self.body_timeout_s = body_timeout_s
        self.runner = ComputeRunner(queue_limit)
        self._server: asyncio.base_events.Server | None = None
        self._sessions: dict[asyncio.Task, _Session] = {}
        self._closing = False

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen and start the compute thread; return the bound (host, port)."""
        self.runner.start()
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[:2]

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
        # The thread's join is under way before the first await: a second cancellation (asyncio.run
        # cancels every task again on its way out) cannot skip it.
        stopped = self.runner.stop()
        sessions = [task for task in self._sessions if task is not asyncio.current_task()]
        for task in sessions:
            # Cancelling alone is not enough on Python 3.11: asyncio.wait_for swallows a cancellation
            # that meets a completed read (gh-86296), and the session would wait for its next frame.
            # The flag and the closed transport end it either way.
            self._sessions[task].writer.transport.abort()
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
        await asyncio.shield(stopped)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = _Session(writer)
        task = asyncio.current_task()
        self._sessions[task] = session
        try:
            while not self._closing and await self._next_frame(reader, session):
                pass
        except (ConnectionError, OSError) as error:
            log.info("connection from %s ended: %s", session.peer, error)
        except asyncio.CancelledError:
            # The server is closing. End quietly: asyncio (3.11) logs a traceback for a
            # connection callback that ends cancelled, and nobody awaits this task.
            pass
        finally:
            self._sessions.pop(task, None)
            dropped = self.runner.drop(session)
            if dropped:
                log.info("connection from %s closed with %d requests queued: dropped", session.peer, dropped)
            for reply in list(session.replies):
                reply.cancel()
            writer.close()

    async def _next_frame(self, reader: asyncio.StreamReader, session: _Session) -> bool:
        """Read and handle one frame; False when the connection is to close."""
        try:
            header = await read_header(reader, None, self.max_payload)
        except StreamClosed as closed:
            return await self._fail(session, 0, "truncated",
                                    f"truncated frame header: {closed.partial} of {HEADER_SIZE} bytes")
        except ProtocolError as error:
            return await self._fail(session, 0, "framing", str(error))
        if header is None:  # clean end of stream
            return False
        try:
            body = await read_body(reader, header, self.body_timeout_s)
        except StreamClosed as closed:
            return await self._fail(session, header.request_id, "truncated",
                                    f"truncated frame: body of {header.body_len} bytes, got {closed.partial}")
        except asyncio.TimeoutError:
            return await self._fail(session, header.request_id, "truncated",
                                    f"truncated frame: body of {header.body_len} bytes not received "
                                    f"within {self.body_timeout_s:g} s")
        reply = self._handle(session, header, body)
        if reply is not None:
            await session.send(reply)
        return True

    def _handle(self, session: _Session, header: Header, body: bytes) -> Frame | None:
        """The immediate reply to one whole frame, or None when a DISPATCH went to the runner."""
        rid = header.request_id
        try:
            frame = decode_frame(header, body)
            if frame.opcode == Opcode.PING:
                return Frame(Opcode.PONG, rid)
            if frame.opcode == Opcode.HELLO:
                return self._hello(session, frame)
            if frame.opcode == Opcode.DISPATCH:
                if not session.greeted:
                    raise ProtocolError("DISPATCH before HELLO: send HELLO with the model fingerprint first")
                future = self.runner.submit(session, functools.partial(self._compute, frame))
                session.track(asyncio.create_task(self._reply_when_done(session, future)))
                return None
            raise ProtocolError(f"unexpected opcode {frame.opcode.name} from a client")
        except WorkerBusy as busy:
            log.warning("request %d refused: %s", rid, busy)
            return ErrorReply("busy", str(busy)).to_frame(rid)
        except MoeSwarmError as error:
            log.warning("request %d refused: %s", rid, error)
            return ErrorReply("bad_request", str(error)).to_frame(rid)

    def _hello(self, session: _Session, frame: Frame) -> Frame:
        session.greeted = False
        hello = Hello.from_frame(frame)
        if hello.fingerprint != self.fingerprint:
            raise ProtocolError(
                f"model fingerprint mismatch: this worker serves {self.info.model_type} model "
                f"{self.fingerprint}, the backbone runs {hello.fingerprint}"
            )
        session.greeted = True
        return self.info.to_frame(frame.request_id)

    def _compute(self, frame: Frame) -> Frame:
        """DISPATCH in, RESULT or ERROR out: decoding, experts and encoding, on the compute thread."""
        rid = frame.request_id
        try:
            return self.store.run(Dispatch.from_frame(frame)).to_frame(rid)
        except MoeSwarmError as error:
            log.warning("request %d refused: %s", rid, error)
            return ErrorReply("bad_request", str(error)).to_frame(rid)
        except Exception as error:  # a bug on our side: report it and keep serving
            log.exception("request %d failed", rid)
            return ErrorReply("internal", f"{type(error).__name__}: {error}").to_frame(rid)

    async def _reply_when_done(self, session: _Session, future: asyncio.Future[Frame]) -> None:
        reply = await future  # cancelled with the connection when it closes first
        try:
            await session.send(reply)
        except (ConnectionError, OSError) as error:
            log.info("reply to %s lost: %s", session.peer, error)

    async def _fail(self, session: _Session, rid: int, code: str, message: str) -> bool:
        """Answer a framing error; the connection closes after it (returns False)."""
        log.warning("closing connection from %s: %s", session.peer, message)
        try:
            await session.send(ErrorReply(code, message).to_frame(rid))
        except (ConnectionError, OSError):
            pass
        return False
