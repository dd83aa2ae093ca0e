"""`moeswarm stage`: a span of decoder layers served to gateways, with their sequences' caches.

Threads: one accepts; one per connection reads frames (HELLO and PING answered at once, STEP
checked and queued) and one sends its frames (outbox.py); one computes, a step at a time in
arrival order: replay the step's cache records, run the span (its MoE layers through the stage's
own dispatcher, to the workers near it), then hand the hidden states to the link to the next stage
(onward.py, which dials on its own thread) or to the session's gateway connection. One keeps house:
HELLO deadlines, stalled outboxes, revoked members, idle onward links. A stage never waits for the
rest of the chain, nor for any peer's reading.

Every frame is bounded before it is read (header checked, payload against the step's token bound,
a deadline per frame). Connections hold slots from accept on, TLS handshake included, capped in
total and per address; at a cap the quietest connection makes room (worker/admission.py). Accepting
never stops: out of descriptors, the accept thread backs off and retries, and frees one from a
quiet connection. Sessions belong to their gateway's connection (sessions.py); each connection's
queued steps and unsent bytes are capped. A bad step costs its sender one ERROR line, never the stage.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from moeswarm.errors import MoeSwarmError, ProtocolError, one_line, printable
from moeswarm.forward.packed import kv_cache_name, kv_dtype
from moeswarm.stages.accept import accept_forever, refuse
from moeswarm.stages.caches import CacheLimits, StageCaches
from moeswarm.stages.connection import Connection
from moeswarm.stages.forward import run_span
from moeswarm.stages.onward import OnwardLimits, OnwardLinks
from moeswarm.stages.outbox import shut
from moeswarm.stages.protocol import Step, error_frame, result_frame
from moeswarm.stages.recompute import run_honestly
from moeswarm.stages.sessions import Session, check_step, parse_hello, tag
from moeswarm.transport.tls import RevocationWatch, revoked_reason
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame
from moeswarm.worker.admission import ConnectionTable, CountedLog, Slot, error_cause

log = logging.getLogger("moeswarm.stage")

HOUSEKEEPING_S = 0.5


@dataclass(frozen=True)
class StageLimits:
    max_connections: int = 64
    max_connections_per_peer: int = 32  # from one IP address
    max_tokens: int = 4096  # rows of one step
    max_queued_steps: int = 64
    queue_per_connection: int = 16  # of those, from one connection
    frame_timeout_s: float = 30.0  # to read one frame once its first byte is in
    hello_timeout_s: float = 10.0  # from accept (TLS handshake included) to a HELLO
    idle_timeout_s: float = 600.0  # a connection sending nothing this long is closed
    evict_after_s: float = 5.0  # at a connection cap, one this quiet (no HELLO or STEP) makes room
    max_unsent_bytes: int = 64 << 20  # a connection's frames its peer has not taken: past it, it is closed
    send_timeout_s: float = 30.0  # a frame not taken by its peer this long: the connection is closed
    onward: OnwardLimits = OnwardLimits()
    caches: CacheLimits = field(default_factory=CacheLimits)


class StageServer:
    def __init__(self, model: PreTrainedModel, span: range, fingerprint: str, limits: StageLimits | None = None,
                 tls_server: ssl.SSLContext | None = None, tls_client: ssl.SSLContext | None = None):
        self.model, self.span, self.fingerprint = model, span, fingerprint
        self.hidden_size = model.config.hidden_size
        self.limits = limits or StageLimits()
        self.caches = StageCaches(self.limits.caches, kv_dtype(model))
        self._tls_server = tls_server
        self._revocations = RevocationWatch(tls_server) if tls_server is not None else None
        self._queue: queue.Queue = queue.Queue()  # (connection, session, step) or ("close", session id); None: stop
        self._queued = 0
        self._sessions: dict[str, Session] = {}
        self._connections: set[Connection] = set()
        self._table = ConnectionTable(self.limits.max_connections, self.limits.max_connections_per_peer,
                                      self.limits.evict_after_s)
        self._onward = OnwardLinks(fingerprint, span.stop, tls_client, self.limits.onward, self._onward_failed)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self.failures = CountedLog(log, "connections refused or failed before a HELLO")
        self.swarm = None  # the swarm holding the span's experts (node.py): its bans make a step be computed again
        self.steps = 0
        self.recomputed = 0  # steps computed again after a ban

    # -- lifecycle -------------------------------------------------------------------------------

    def listen(self, host: str, port: int) -> int:
        """Bind and start serving; returns the port."""
        self._listener = socket.create_server((host, port), backlog=128)
        for target, name in ((self._accept, "accept"), (self._compute, "compute"), (self._keep_house, "house")):
            threading.Thread(target=target, name=f"moeswarm-stage-{name}", daemon=True).start()
        return self._listener.getsockname()[1]

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            shut(self._listener, close=True)
        with self._lock:
            connections = list(self._connections)
            slots = list(self._table.slots)
        for connection in connections:
            connection.drop("the stage is closing")
        for slot in slots:
            slot.evict("the stage is closing")
        self._onward.close()
        self._queue.put(None)

    def serve_forever(self) -> None:
        self._closed.wait()

    @property
    def connections(self) -> int:
        """Connection slots held (TLS handshakes and connections awaiting HELLO included)."""
        with self._lock:
            return len(self._table)

    # -- connections -----------------------------------------------------------------------------

    def _accept(self) -> None:
        accept_forever(lambda: self._listener, self._closed, self._admit, self._free_descriptor, self.failures)

    def _admit(self, sock: socket.socket, address: tuple) -> None:
        with self._lock:
            slot = self._table.admit(address[0], "stage connection")
            if isinstance(slot, Slot):
                slot.evict = lambda message, s=sock: shut(s)
        if not isinstance(slot, Slot):
            self.failures.note("refused: connections at their limit")
            refuse(sock, slot)
            return
        threading.Thread(target=self._serve, args=(sock, f"{address[0]}:{address[1]}", slot), daemon=True,
                         name="moeswarm-stage-conn").start()

    def _free_descriptor(self) -> None:
        """Out of descriptors: a quiet connection's, for the ones waiting to be accepted."""
        with self._lock:
            self._table._evict(self._table.slots, time.monotonic(), "while descriptors ran out")

    def _serve(self, sock: socket.socket, peer: str, slot: Slot) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls_server is not None:
                sock.settimeout(self.limits.hello_timeout_s)
                sock = self._tls_server.wrap_socket(sock, server_side=True)
        except (OSError, ssl.SSLError) as error:
            self.failures.note(f"TLS handshake: {error_cause(error)}")
            with self._lock:
                self._table.release(slot)
            shut(sock, close=True)
            return
        connection = Connection(sock, peer, slot, self.limits.max_unsent_bytes, self.limits.send_timeout_s,
                                lambda reason, frames: self._send_failed(connection, reason))
        with self._lock:
            slot.evict = connection.drop
            self._connections.add(connection)
            if slot.released:  # evicted during the handshake
                connection.drop("evicted")
        # One timeout for the socket's life: the outbox's thread sends on it while this one reads, so
        # nobody changes it; a frame's whole-read deadline is kept by the housekeeping (`reading_since`).
        sock.settimeout(self.limits.send_timeout_s)
        try:
            while not self._closed.is_set() and connection.dropped is None:
                if not self._readable(sock):
                    return
                connection.reading_since = time.monotonic()
                try:
                    frame, _ = recv_frame(sock, None, max_payload=self._max_payload())
                except ProtocolError as error:
                    connection.send(error_frame("", 0, "bad_frame", one_line(error)))
                    time.sleep(0.05)  # the ERROR's chance to leave before the close
                    return  # the stream cannot be trusted past a bad header
                connection.reading_since = None
                self._handle(connection, frame)
        except (OSError, ConnectionError, socket.timeout):
            return
        except Exception as error:  # a bug set off by one peer: that connection ends, in one line
            log.warning("connection from %s closed: %s", peer, printable(one_line(error), 300))
        finally:
            self._forget(connection)

    def _forget(self, connection: Connection) -> None:
        """A connection's end: its slot, its session (and the session's caches), its outbox."""
        with self._lock:
            self._table.release(connection.slot)
            self._connections.discard(connection)
            session = connection.session
            if session is not None and self._sessions.get(session.id) is session:
                del self._sessions[session.id]
                self._queue.put(("close", session.id))
        connection.outbox.fail("closed")
        shut(connection.sock, close=True)

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
                self._take_step(connection, frame)
            else:
                raise ProtocolError(f"a stage does not take {frame.opcode.name}")
        except ProtocolError as error:
            session = frame.meta.get("session") if isinstance(frame.meta.get("session"), str) else ""
            connection.send(error_frame(session[:64], frame.request_id, "bad_request", one_line(error)))

    def _hello(self, connection: Connection, frame: Frame) -> None:
        role, fingerprint = frame.meta.get("role"), frame.meta.get("fingerprint")
        if connection.role is not None:
            raise ProtocolError("this connection has said HELLO already: one HELLO, one session, per connection")
        if fingerprint != self.fingerprint:
            raise ProtocolError(f"model fingerprint {printable(str(fingerprint), 80)} is not this stage's "
                                f"{self.fingerprint}: another model")
        if role == "gateway":
            session = parse_hello(frame.meta, connection, connection.member)
            with self._lock:
                if session.id in self._sessions:
                    raise ProtocolError("that session is open on another connection here")
                self._sessions[session.id] = session
                connection.session = session
        elif role != "stage":
            raise ProtocolError(f"HELLO role must be gateway or stage, got {printable(str(role), 40)}")
        connection.role = role
        with self._lock:
            connection.slot.greeted = True
            connection.slot.last_active = time.monotonic()
        connection.send(Frame(Opcode.HELLO, frame.request_id, {
            "role": "stage", "fingerprint": self.fingerprint, "layers": [self.span.start, self.span.stop - 1],
            "hidden_size": self.hidden_size, "kv_cache": kv_cache_name(self.model)}))

    def _take_step(self, connection: Connection, frame: Frame) -> None:
        if connection.role is None:
            raise ProtocolError("HELLO first: a stage takes steps only from a connection that said HELLO")
        step = Step.from_frame(frame, self.hidden_size, self.limits.max_tokens)
        with self._lock:
            session = self._sessions.get(step.session)
            check_step(step, session, connection, connection.role == "stage")
            if self._queued >= self.limits.max_queued_steps:
                raise ProtocolError(f"{self.limits.max_queued_steps} steps are queued here: busy")
            if connection.queued >= self.limits.queue_per_connection:
                raise ProtocolError(f"{self.limits.queue_per_connection} steps of this connection are queued here: "
                                    "wait for their answers")
            self._queued += 1
            connection.queued += 1
            connection.slot.last_active = time.monotonic()
        self._queue.put((connection, session, step))

    def _send_failed(self, connection: Connection, reason: str) -> None:
        if reason != "closed":
            log.info("connection from %s closed: %s", connection.peer, printable(reason, 200))
        connection.drop(reason)

    def _keep_house(self) -> None:
        """HELLO and frame deadlines, stalled outboxes, members revoked while connected (checked when the
        revocation list changes), idle onward links."""
        while not self._closed.wait(HOUSEKEEPING_S):
            try:
                self._keep_house_once()
            except Exception as error:  # a bug here must not end the housekeeping
                log.warning("housekeeping failed: %s", printable(one_line(error), 300))

    def _keep_house_once(self) -> None:
        """One round of `_keep_house`."""
        now = time.monotonic()
        with self._lock:
            silent = [s for s in self._table.slots if not s.greeted and now - s.opened > self.limits.hello_timeout_s]
            connections = list(self._connections)
        for slot in silent:
            slot.evict(f"no HELLO within {self.limits.hello_timeout_s:g} s")
        revoked = self._revocations is not None and self._revocations.changed()
        for connection in connections:
            since = connection.reading_since
            if since is not None and now - since > self.limits.frame_timeout_s:
                connection.drop(f"a frame not read whole within {self.limits.frame_timeout_s:g} s")
            elif connection.outbox.stalled(now):
                connection.outbox.fail(f"took no bytes for {self.limits.send_timeout_s:g} s")
            elif revoked:
                _check_member(connection)
        self._onward.expire(now)
        if revoked:
            from moeswarm.transport.tls import check_peer

            self._onward.check(check_peer)
        self.failures.tick()

    # -- compute ---------------------------------------------------------------------------------

    def _compute(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if item[0] == "close":
                self.caches.close_session(item[1])
                continue
            connection, session, step = item
            with self._lock:
                self._queued -= 1
                connection.queued -= 1
                live = self._sessions.get(session.id) is session
            if not live:
                continue  # its gateway has gone: nobody to answer, and its caches are closed
            try:
                self._step(session, step)
            except Exception as error:  # one step's failure is its sender's, never the stage's
                code = "bad_step" if isinstance(error, (ProtocolError, MoeSwarmError)) else "stage_failed"
                message = f"stage {self.span.start}-{self.span.stop - 1}: {one_line(error)}"
                log.warning("step %d of session %s failed: %s", step.step, tag(session.id), printable(message, 300))
                session.owner.send(error_frame(session.id, step.step, code, message))

    def _step(self, session: Session, step: Step) -> None:
        self.caches.apply(step.session, step.records, frozenset(s.seq for s in step.segments))
        caches = self.caches.take(step.session, step.segments)
        hidden = self._run_honestly(caches, step)  # [T, d]
        self.caches.settle(step.session, step.segments)
        self.steps += 1
        if step.route:
            onward = Step(step.session, step.step, step.route[1:], step.records, step.segments, hidden,
                          session.onward_token)
            self._onward.send(session.onward, onward.to_frame())
        else:
            session.owner.send(result_frame(step.session, step.step, hidden))

    def _run_honestly(self, caches: list, step: Step):
        """The span over the step's rows, computed again when a holder it used is banned meanwhile."""
        if self.swarm is None:
            return run_span(self.model, caches, step.segments, step.hidden)
        hidden, again = run_honestly(self.model, self.swarm, caches, step.segments, step.hidden, tag(step.session))
        self.recomputed += again
        return hidden

    def _onward_failed(self, address: str, reason: str, frames: list[Frame]) -> None:
        """Steps a link to the next stage never delivered: each session's gateway hears it in one line."""
        for frame in frames:
            session_id = frame.meta.get("session")
            with self._lock:
                session = self._sessions.get(session_id) if isinstance(session_id, str) else None
            if session is not None:
                message = (f"stage {self.span.start}-{self.span.stop - 1}: the next stage {printable(address, 80)} "
                           f"did not take the step: {printable(reason, 200)}")
                session.owner.send(error_frame(session.id, frame.request_id, "stage_failed", message))


def _check_member(connection: Connection) -> None:
    """Close a connection whose member was revoked while it was connected."""
    if isinstance(connection.sock, ssl.SSLSocket) and connection.dropped is None:
        why = revoked_reason(connection.sock)
        if why is not None:
            log.warning("connection from %s closed: %s", connection.peer, printable(why, 200))
            connection.drop(f"member revoked: {why}")
