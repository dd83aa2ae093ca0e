"""`moeswarm stage`: a span of decoder layers served to gateways, with their sequences' caches.

Threads: one accepts; one per connection reads frames (HELLO and PING answered at once, STEP
queued); one computes, a step at a time in arrival order: replay the step's cache records, run the
span (its MoE layers through the stage's own dispatcher, to the workers near it), then send the
hidden states on to the next stage of the route, or back to the gateway on the gateway's own
connection (its session). A stage never waits for the rest of the chain: the next step can enter
while this one is further down the route.

Every frame is bounded before it is read (header checked, payload against the step's token bound,
a deadline per frame), connections are capped, and a bad step costs its sender one ERROR line,
never the stage.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from transformers import PreTrainedModel

from moeswarm.errors import MoeSwarmError, ProtocolError, one_line, printable
from moeswarm.generation.ragged import kv_cache_name, kv_dtype
from moeswarm.stages.caches import CacheLimits, StageCaches
from moeswarm.stages.dial import DialError, dial
from moeswarm.stages.forward import run_span
from moeswarm.stages.protocol import Step, error_frame, result_frame
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

log = logging.getLogger("moeswarm.stage")


@dataclass(frozen=True)
class StageLimits:
    max_connections: int = 64
    max_tokens: int = 4096  # rows of one step
    max_queued_steps: int = 64
    frame_timeout_s: float = 30.0  # to read one frame once its first byte is in
    idle_timeout_s: float = 600.0  # a connection sending nothing this long is closed
    connect_timeout_s: float = 10.0  # to reach the next stage
    caches: CacheLimits = CacheLimits()


class Connection:
    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.session: str | None = None
        self._send = threading.Lock()

    def send(self, frame: Frame) -> None:
        with self._send:
            send_frame(self.sock, frame)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class StageServer:
    def __init__(self, model: PreTrainedModel, span: range, fingerprint: str, limits: StageLimits | None = None,
                 tls_server: ssl.SSLContext | None = None, tls_client: ssl.SSLContext | None = None):
        self.model, self.span, self.fingerprint = model, span, fingerprint
        self.hidden_size = model.config.hidden_size
        self.limits = limits or StageLimits()
        self.caches = StageCaches(self.limits.caches, kv_dtype(model))
        self._tls_server, self._tls_client = tls_server, tls_client
        self._queue: queue.Queue = queue.Queue(self.limits.max_queued_steps)
        self._sessions: dict[str, Connection] = {}
        self._onward: dict[str, Connection] = {}
        self._connections: set[Connection] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self.steps = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def listen(self, host: str, port: int) -> int:
        """Bind and start serving; returns the port."""
        self._listener = socket.create_server((host, port), backlog=128)
        threading.Thread(target=self._accept, name="moeswarm-stage-accept", daemon=True).start()
        threading.Thread(target=self._compute, name="moeswarm-stage-compute", daemon=True).start()
        return self._listener.getsockname()[1]

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            connections = list(self._connections) + list(self._onward.values())
        for connection in connections:
            connection.close()
        self._queue.put(None)

    def serve_forever(self) -> None:
        self._closed.wait()

    # -- connections -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._connections) >= self.limits.max_connections
            if full:
                log.warning("refused a connection from %s: %d connections open, the limit",
                            address[0], self.limits.max_connections)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, f"{address[0]}:{address[1]}"), daemon=True,
                             name="moeswarm-stage-conn").start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self._tls_server is not None:
                sock.settimeout(self.limits.frame_timeout_s)
                sock = self._tls_server.wrap_socket(sock, server_side=True)
        except (OSError, ssl.SSLError) as error:
            log.info("TLS handshake with %s failed: %s", peer, printable(one_line(error), 200))
            sock.close()
            return
        connection = Connection(sock, peer)
        with self._lock:
            self._connections.add(connection)
        try:
            while not self._closed.is_set():
                if not self._readable(sock):
                    return
                try:
                    frame, _ = recv_frame(sock, time.monotonic() + self.limits.frame_timeout_s,
                                          max_payload=self._max_payload())
                except ProtocolError as error:
                    connection.send(error_frame("", 0, "bad_frame", one_line(error)))
                    return  # the stream cannot be trusted past a bad header
                self._handle(connection, frame)
        except (OSError, ConnectionError, socket.timeout):
            return
        except Exception as error:  # a bug set off by one peer: that connection ends, in one line
            log.warning("connection from %s closed: %s", peer, printable(one_line(error), 300))
        finally:
            with self._lock:
                self._connections.discard(connection)
                if connection.session is not None and self._sessions.get(connection.session) is connection:
                    del self._sessions[connection.session]
            connection.close()

    def _readable(self, sock: socket.socket) -> bool:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        ready, _, _ = select.select([sock], [], [], self.limits.idle_timeout_s)
        return bool(ready)

    def _max_payload(self) -> int:
        return self.limits.max_tokens * self.hidden_size * 4 + 4096

    def _handle(self, connection: Connection, frame: Frame) -> None:
        try:
            if frame.opcode == Opcode.HELLO:
                self._hello(connection, frame)
            elif frame.opcode == Opcode.PING:
                connection.send(Frame(Opcode.PONG, frame.request_id))
            elif frame.opcode == Opcode.STEP:
                step = Step.from_frame(frame, self.hidden_size, self.limits.max_tokens)
                try:
                    self._queue.put_nowait((connection, step))
                except queue.Full:
                    raise ProtocolError(f"{self.limits.max_queued_steps} steps are queued here: busy") from None
            else:
                raise ProtocolError(f"a stage does not take {frame.opcode.name}")
        except ProtocolError as error:
            session = frame.meta.get("session") if isinstance(frame.meta.get("session"), str) else ""
            connection.send(error_frame(session[:64], frame.request_id, "bad_request", one_line(error)))

    def _hello(self, connection: Connection, frame: Frame) -> None:
        role, fingerprint = frame.meta.get("role"), frame.meta.get("fingerprint")
        if fingerprint != self.fingerprint:
            raise ProtocolError(f"model fingerprint {printable(str(fingerprint), 80)} is not this stage's "
                                f"{self.fingerprint}: another model")
        if role == "gateway":
            session = frame.meta.get("session")
            if not isinstance(session, str) or not 0 < len(session) <= 64 or not session.isprintable():
                raise ProtocolError("a gateway's HELLO names its session (1-64 printable characters)")
            with self._lock:
                self._sessions[session] = connection
            connection.session = session
        elif role != "stage":
            raise ProtocolError(f"HELLO role must be gateway or stage, got {printable(str(role), 40)}")
        connection.send(Frame(Opcode.HELLO, frame.request_id, {
            "role": "stage", "fingerprint": self.fingerprint, "layers": [self.span.start, self.span.stop - 1],
            "hidden_size": self.hidden_size, "kv_cache": kv_cache_name(self.model)}))

    # -- compute ---------------------------------------------------------------------------------

    def _compute(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            connection, step = item
            try:
                self._step(step)
            except Exception as error:  # one step's failure is its sender's, never the stage's
                code = "bad_step" if isinstance(error, (ProtocolError, MoeSwarmError)) else "stage_failed"
                message = f"stage {self.span.start}-{self.span.stop - 1}: {one_line(error)}"
                log.warning("step %d of session %s failed: %s", step.step, printable(step.session, 64),
                            printable(message, 300))
                try:
                    self._answer(step.session, connection, error_frame(step.session, step.step, code, message))
                except Exception as failure:  # the compute thread outlives any one answer
                    log.warning("could not answer session %s: %s", printable(step.session, 64), one_line(failure))

    def _step(self, step: Step) -> None:
        self.caches.apply(step.session, step.records)
        caches = self.caches.take(step.session, step.segments)
        hidden = run_span(self.model, caches, step.segments, step.hidden)  # [T, d]
        self.caches.settle(step.session, step.segments)
        self.steps += 1
        if step.route:
            onward = Step(step.session, step.step, step.route[1:], step.records, step.segments, hidden)
            self._onward_send(step.route[0], onward.to_frame())
        else:
            self._answer(step.session, None, result_frame(step.session, step.step, hidden))

    def _answer(self, session: str, fallback: Connection | None, frame: Frame) -> None:
        with self._lock:
            connection = self._sessions.get(session, fallback)
        if connection is None:
            log.warning("no gateway connection for session %s: an answer dropped", printable(session, 64))
            return
        try:
            connection.send(frame)
        except OSError as error:
            log.info("gateway of session %s unreachable: %s", printable(session, 64), printable(one_line(error), 200))

    def _onward_send(self, address: str, frame: Frame) -> None:
        connection = self._onward.get(address)
        if connection is None:
            connection = self._dial(address)
        try:
            connection.send(frame)
        except OSError:
            connection.close()
            self._onward.pop(address, None)
            self._dial(address).send(frame)  # once more on a fresh connection

    def _dial(self, address: str) -> Connection:
        hello = {"role": "stage", "fingerprint": self.fingerprint}
        try:
            sock, _ = dial(address, hello, self._tls_client, self.limits.connect_timeout_s)
        except DialError as error:
            raise MoeSwarmError(f"the next stage {printable(address, 80)} is unreachable: {one_line(error)}") from None
        connection = Connection(sock, address)
        self._onward[address] = connection
        return connection
