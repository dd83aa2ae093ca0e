"""A worker process reached over one persistent TCP connection (blocking sockets).

Blocking, on purpose: the model's forward is synchronous, and sending every worker its frame
before reading any reply already gives a parallel star (replies wait in the kernel's buffers);
no event loop or thread hop sits on the per-layer hot path.

Replies are matched by request id: a worker answers PING at once even while it computes, so a
PONG may overtake a RESULT. Any failure that leaves the stream out of step (timeout, broken frame,
lost connection, a reply nobody asked for) closes the socket; the next call reconnects.
"""

from __future__ import annotations

import socket
import time

from moeswarm.errors import MoeSwarmError, ProtocolError, WorkerError
from moeswarm.ids import WorkerAddress, parse_address
from moeswarm.transport.link import Pending, Reply
from moeswarm.wire.codecs import get_codec
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result, WorkerInfo
from moeswarm.wire.stream import StreamClosed, recv_frame, send_frame

CONNECT_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 30.0


class TcpLink:
    def __init__(self, address: str):
        self.address = WorkerAddress(address)
        self.info: WorkerInfo | None = None
        self._fingerprint: str | None = None
        self._sock: socket.socket | None = None
        self._next_id = 1
        self._waiting: dict[int, int] = {}  # request id sent and not yet answered -> largest payload its reply may have
        self._early: dict[int, tuple[Frame, int]] = {}  # replies that overtook the one awaited

    @property
    def broken(self) -> bool:
        return self._sock is None

    def connect(self, fingerprint: str) -> WorkerInfo:
        try:
            host, port = parse_address(self.address)
        except ValueError as error:
            raise WorkerError(self.address, str(error)) from None
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as error:
            raise WorkerError(self.address, f"cannot connect ({error.strerror or error}): is the worker running?") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._waiting, self._early = sock, {}, {}
        pending = self._send(Hello(fingerprint).to_frame(self._new_id()))
        frame, _ = self._receive(pending.request_id, time.monotonic() + HELLO_TIMEOUT_S)
        try:
            info = WorkerInfo.from_frame(frame)
        except ProtocolError as error:
            self.close()
            raise WorkerError(self.address, f"bad HELLO answer: {error}") from None
        if info.fingerprint != fingerprint:
            self.close()
            raise WorkerError(self.address, f"serves model {info.fingerprint}, not {fingerprint}")
        self._fingerprint, self.info = fingerprint, info
        return info

    def reconnect(self) -> WorkerInfo:
        before = self.info
        if self._fingerprint is None or before is None:
            raise WorkerError(self.address, "never connected")
        self.close()
        info = self.connect(self._fingerprint)
        if info.held != before.held:
            self.close()
            raise WorkerError(self.address, "came back holding other experts than it announced: not used again")
        return info

    def prepare(self, request: Dispatch) -> tuple[Frame, int]:
        """The DISPATCH frame, and the exact payload size of the RESULT that answers it."""
        return request.to_frame(self._new_id()), result_payload_bytes(request)

    def send(self, prepared: tuple[Frame, int]) -> Pending:
        return self._send(*prepared)

    def _send(self, frame: Frame, reply_payload_limit: int = 0) -> Pending:
        """Write `frame`; its reply may carry at most `reply_payload_limit` payload bytes (a larger
        one is refused from its header, before anything is allocated or read)."""
        sock = self._require()
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sent = send_frame(sock, frame)
        except OSError as error:
            self.close()
            raise WorkerError(self.address, f"connection lost while sending ({error})") from None
        self._waiting[frame.request_id] = reply_payload_limit
        return Pending(frame.request_id, sent, time.perf_counter())

    def wait(self, pending: Pending, deadline: float) -> Reply:
        frame, received = self._receive(pending.request_id, deadline)
        seconds = time.perf_counter() - pending.sent_at
        try:
            result = Result.from_frame(frame)
        except MoeSwarmError as error:  # the frame was read whole: the stream is still in step
            raise WorkerError(self.address, f"bad RESULT: {error}") from None
        return Reply(result, received, seconds)

    def ping(self, timeout_s: float = 10.0) -> float:
        start = time.perf_counter()
        pending = self._send(Frame(Opcode.PING, self._new_id()))
        self._receive(pending.request_id, time.monotonic() + timeout_s)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise WorkerError(self.address, "not connected")
        return self._sock

    def _receive(self, request_id: int, deadline: float) -> tuple[Frame, int]:
        """The reply to `request_id`; replies to other outstanding requests are kept for later."""
        while request_id not in self._early:
            frame, size = self._read(deadline)
            if frame.request_id not in self._waiting:
                self.close()
                raise WorkerError(self.address, f"reply to request {frame.request_id}, which is not outstanding")
            self._early[frame.request_id] = (frame, size)
        frame, size = self._early.pop(request_id)
        self._waiting.pop(request_id, None)
        if frame.opcode == Opcode.ERROR:
            raise WorkerError(self.address, ErrorReply.from_frame(frame).message)
        return frame, size

    def _read(self, deadline: float) -> tuple[Frame, int]:
        sock = self._require()
        try:
            return recv_frame(sock, deadline, max(self._waiting.values(), default=0))
        except socket.timeout:
            self.close()
            raise WorkerError(self.address, "no reply before the deadline (worker stalled or overloaded?)") from None
        except StreamClosed:
            self.close()
            raise WorkerError(self.address, "connection closed by the worker (is it down?)") from None
        except ProtocolError as error:
            self.close()
            raise WorkerError(self.address, f"bad reply: {error}") from None
        except OSError as error:
            self.close()
            raise WorkerError(self.address, f"connection lost while reading ({error})") from None


def result_payload_bytes(request: Dispatch) -> int:
    """The payload size of the RESULT that answers `request`: its rows times the hidden size in the
    reply codec (exact: one row per routed (token, expert) pair; partial: one per token)."""
    tokens, width = request.hidden.shape  # [T_w, d]
    rows = int((request.top_k_index >= 0).sum()) if request.mode == CombineMode.EXACT else tokens
    return get_codec(request.wire_combine).nbytes((rows, width))
