"""A worker process reached over one persistent TCP connection, from the backbone's own thread.

No event loop, on purpose: the model's forward is synchronous, and sending every worker its frame
before reading any reply already gives a parallel star (replies wait in the kernel's buffers);
no event loop or thread hop sits on the per-layer hot path. A plain socket is non-blocking and
awaited with select: each recv and send is one system call (a socket with a timeout polls before
each), and a reply's body, which follows its header in the same write, is taken without a second
select.

Replies are matched by request id: a worker answers PING at once even while it computes, so a
PONG may overtake a RESULT. Any failure that leaves the stream out of step (timeout, broken frame,
lost connection, a reply nobody asked for) closes the socket; the next call reconnects.

Several requests may be in flight at once (a hedged duplicate, a spot check): `pump` reads one
whole frame when the socket is readable, `has_reply` says whether a request's reply is in, and
`forget` gives up on a request: its reply, when it comes, is read (within its size limit) and
dropped, so the stream stays in step without waiting for it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time

import numpy as np

from moeswarm.errors import MoeSwarmError, ProtocolError, WorkerError
from moeswarm.ids import WorkerAddress, parse_address
from moeswarm.transport import token_call
from moeswarm.transport.link import Pending, Reply
from moeswarm.transport.tls import PeerRefused, refusal_hint
from moeswarm.wire.codecs import get_codec
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Frame, Header, Opcode, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result, WorkerInfo
from moeswarm.wire.stream import StreamClosed, decode_frame, send_frame

CONNECT_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = CONNECT_TIMEOUT_S  # the most a send waits for the worker to take its bytes
HELLO_PAYLOAD_LIMIT = 0  # a HELLO answer is all metadata: no payload bytes are accepted
CLOSED_BY_WORKER = "connection closed by the worker (is it down?)"
LOST_WHILE_READING = "connection lost while reading"


class TcpLink:
    def __init__(self, address: str, tls: ssl.SSLContext | None = None):
        self.address = WorkerAddress(address)
        self.tls = tls  # the swarm key's client context (transport/tls.py); None: plain TCP
        self.info: WorkerInfo | None = None
        self._fingerprint: str | None = None
        self._sock: socket.socket | None = None
        self._next_id = 1
        self._waiting: dict[int, int] = {}  # request id sent and not yet answered -> largest payload its reply may have
        self._early: dict[int, tuple[Frame, int]] = {}  # replies that overtook the one awaited
        self._dropped: set[int] = set()  # forgotten requests: their replies are read and discarded
        self._inbox = Inbox()

    @property
    def broken(self) -> bool:
        return self._sock is None

    def connect(self, fingerprint: str, timeout_s: float | None = None) -> WorkerInfo:
        """timeout_s: for the TCP connect and the HELLO answer (default 10 s and 30 s)."""
        sock = self._dial(timeout_s or CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock)  # the handshake, within the connect timeout
            except OSError as error:  # ssl.SSLError included
                sock.close()
                if isinstance(error, PeerRefused):  # it holds the key, but this process refuses it
                    raise WorkerError(self.address, f"TLS handshake failed ({error})") from None
                raise WorkerError(self.address, f"TLS handshake failed ({error}): does the worker hold the same "
                                                "--swarm-key?") from None
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(CONNECT_TIMEOUT_S)  # what a send may block for, set once; replies are awaited with select
        else:
            # Non-blocking: a socket with a timeout polls before every recv and send (two system calls
            # each); replies are awaited with select anyway, and a send waits for room within SEND_TIMEOUT_S.
            sock.setblocking(False)
        self._sock, self._waiting, self._early, self._dropped, self._inbox = sock, {}, {}, set(), Inbox()
        pending = self._send(Hello(fingerprint).to_frame(self._new_id()), HELLO_PAYLOAD_LIMIT)
        try:
            frame, _ = self._receive(pending.request_id, time.monotonic() + (timeout_s or HELLO_TIMEOUT_S))
        except WorkerError as error:
            if self.tls is None or not error.cause.startswith((CLOSED_BY_WORKER, LOST_WHILE_READING)):
                raise  # a refused member sees a close, or a reset when its HELLO was still unread
            raise WorkerError(self.address, f"connection closed by the worker after the TLS handshake "
                                            f"({refusal_hint(self.tls)})") from None
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

    def _dial(self, timeout_s: float) -> socket.socket:
        """A connected socket on which TLS and HELLO follow (a relay's link dials the relay instead)."""
        try:
            host, port = parse_address(self.address)
        except ValueError as error:
            raise WorkerError(self.address, str(error)) from None
        try:
            return socket.create_connection((host, port), timeout=timeout_s)
        except OSError as error:
            raise WorkerError(self.address, f"cannot connect ({error.strerror or error}): is the worker running?") from None

    def reconnect(self, timeout_s: float | None = None) -> WorkerInfo:
        before = self.info
        if self._fingerprint is None or before is None:
            raise WorkerError(self.address, "never connected")
        self.close()
        info = self.connect(self._fingerprint, timeout_s)
        if info.held != before.held:
            self.info = before  # what it must announce to come back
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
            sent = send_frame(sock, frame, time.monotonic() + SEND_TIMEOUT_S)  # a TLS socket's timeout: set in connect
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

    def fileno(self) -> int | None:
        """The socket to select on for replies (None when closed)."""
        return None if self._sock is None else self._sock.fileno()

    def buffered(self) -> bool:
        """Bytes already read from the network but not yet returned by the socket (TLS records)."""
        pending = getattr(self._sock, "pending", None)
        return bool(pending and pending())

    def has_reply(self, pending: Pending) -> bool:
        """Whether `pending`'s reply has been read (by `pump` or while awaiting another)."""
        return pending.request_id in self._early

    def pump(self, deadline: float) -> None:
        """Read what the socket holds now (it is readable) without blocking; keep whole frames for
        `wait`. A frame in progress stays in the inbox, so a trickling peer holds nobody up."""
        self._pump_once()

    def forget(self, pending: Pending) -> None:
        """Give up on `pending`: its reply is dropped, now or when it arrives."""
        if self._early.pop(pending.request_id, None) is not None:
            self._waiting.pop(pending.request_id, None)
        elif pending.request_id in self._waiting:
            self._dropped.add(pending.request_id)

    def ping(self, timeout_s: float = 10.0) -> float:
        start = time.perf_counter()
        pending = self._send(Frame(Opcode.PING, self._new_id()))
        self._receive(pending.request_id, time.monotonic() + timeout_s)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- a lane's direct use of the socket (dispatch/lane.py) ----------------------------------

    def direct_fd(self) -> int | None:
        """The plain socket's descriptor when nothing is in flight or half-read on it, so that a lane
        may send its frames and read their replies on it directly; None otherwise (TLS, closed, busy)."""
        sock = self._sock
        if sock is None or self._waiting or self._early or not self._inbox.idle or isinstance(sock, ssl.SSLSocket):
            return None
        return sock.fileno()

    def new_request_id(self) -> int:
        return self._new_id()

    def sent_directly(self, request_id: int, bytes_out: int, reply_payload_limit: int, sent_at: float) -> Pending:
        """A lane sent request `request_id`: its reply is awaited as `send`'s are (`wait` may read it)."""
        self._waiting[request_id] = reply_payload_limit
        return Pending(request_id, bytes_out, sent_at)

    def taken_directly(self, pending: Pending) -> None:
        """The lane read `pending`'s reply itself and used it."""
        self._waiting.pop(pending.request_id, None)

    def kept_directly(self, frame: bytes) -> None:
        """A whole frame the lane read and did not use: kept for `wait`, as if this link had read it."""
        with self._reading():
            header = parse_header(frame[:HEADER_SIZE], self._limit())
            self._keep(decode_frame(header, frame[HEADER_SIZE:]), len(frame))

    def resumed_directly(self, header: bytes) -> None:
        """A frame's header the lane read and will not read on: the rest is read (and the header
        judged) by this link's own reads, as if it had read the header itself."""
        self._inbox.resume(header)

    def lost_directly(self, outcome: int, sending: bool = False) -> WorkerError:
        """The lane's send or read ended in `outcome` (transport/token_call.py), which leaves the stream
        out of step: the link closes; the error to raise, worded as this link's own sends and reads word it."""
        self.close()
        if sending:
            return WorkerError(self.address, f"connection lost while sending ({token_call.OUTCOMES[outcome]})")
        if outcome == token_call.TIMEOUT:
            return WorkerError(self.address, "no reply before the deadline (worker stalled or overloaded?)")
        if outcome == token_call.CLOSED:
            return WorkerError(self.address, CLOSED_BY_WORKER)
        return WorkerError(self.address, f"{LOST_WHILE_READING} ({token_call.OUTCOMES[outcome]})")

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
            self._keep(*self._read(deadline))
        frame, size = self._early.pop(request_id)
        self._waiting.pop(request_id, None)
        if frame.opcode == Opcode.ERROR:
            raise WorkerError(self.address, ErrorReply.from_frame(frame).message)
        return frame, size

    def _keep(self, frame: Frame, size: int) -> None:
        if frame.request_id not in self._waiting:
            self.close()
            raise WorkerError(self.address, f"reply to request {frame.request_id}, which is not outstanding")
        if frame.request_id in self._dropped:
            self._dropped.discard(frame.request_id)
            self._waiting.pop(frame.request_id)
            return
        self._early[frame.request_id] = (frame, size)

    def _read(self, deadline: float) -> tuple[Frame, int]:
        """The next whole frame before `deadline` (the deadline covers the whole frame: a peer that
        trickles one byte a second cannot hold the caller beyond it)."""
        with self._reading():
            sock = self._require()
            while (got := self._inbox.next_frame(self._limit())) is None:
                if self._inbox.receive_now(sock):  # the body that follows a header is usually there already
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not (self.buffered() or select.select([sock], [], [], left)[0]):
                    raise socket.timeout
                self._inbox.receive(sock)
            return got

    def _pump_once(self) -> None:
        with self._reading():
            sock = self._require()
            self._inbox.receive(sock)
            while True:
                got = self._inbox.next_frame(self._limit())
                if got is not None:
                    self._keep(*got)
                elif not self._inbox.receive_now(sock):  # the frame's body, when it is there already
                    return

    def _limit(self) -> int:
        return max(self._waiting.values(), default=0)

    @contextlib.contextmanager
    def _reading(self):
        """Turn what can go wrong while reading into a WorkerError (and a closed link)."""
        try:
            yield
        except socket.timeout:
            self.close()
            raise WorkerError(self.address, "no reply before the deadline (worker stalled or overloaded?)") from None
        except StreamClosed:
            self.close()
            raise WorkerError(self.address, CLOSED_BY_WORKER) from None
        except ProtocolError as error:
            self.close()
            raise WorkerError(self.address, f"bad reply: {error}") from None
        except OSError as error:
            self.close()
            raise WorkerError(self.address, f"{LOST_WHILE_READING} ({error})") from None


class Inbox:
    """Bytes read from a socket, cut into frames. Each header is checked against the payload limit
    before its body is read, and no more is read than the frame in progress needs: its header
    into a 24-byte buffer, then its body straight into a buffer of the body's size (no joins)."""

    CHUNK = 1 << 20

    @property
    def idle(self) -> bool:
        """Nothing of a frame read yet."""
        return self._header is None and self._got == 0

    def __init__(self):
        self._head = bytearray(HEADER_SIZE)
        self._body: bytearray | None = None  # allocated once the header is checked
        self._got = 0  # bytes of the part in progress (header, then body)
        self._header: Header | None = None

    def resume(self, header: bytes) -> None:
        """A frame's header read elsewhere: go on from it (nothing of a frame may have been read here)."""
        self._head[:] = header
        self._got = HEADER_SIZE

    def receive(self, sock: socket.socket) -> None:
        """One recv (the socket is readable) of at most what the current frame lacks."""
        if self._header is None:
            view, need = memoryview(self._head)[self._got :], HEADER_SIZE - self._got
        else:
            need = self._header.body_len - self._got
            view = memoryview(self._body)[self._got : self._got + min(need, self.CHUNK)]
        try:
            got = sock.recv_into(view) if need else 0
        except BlockingIOError:  # readable, yet nothing to take (a plain socket is non-blocking): look again
            return
        self._count(need, got)

    def receive_now(self, sock: socket.socket) -> bool:
        """With a header read and its body due: take what of the body has arrived, without waiting
        (one non-blocking recv; a TLS socket only what it holds decrypted). False when nothing was
        there: a frame's body follows its header in the same write, so after a header this mostly
        saves a select and a pass of the caller's loop."""
        if self._header is None or self._got >= self._header.body_len:
            return False
        need = self._header.body_len - self._got
        view = memoryview(self._body)[self._got : self._got + min(need, self.CHUNK)]
        if isinstance(sock, ssl.SSLSocket):
            if not sock.pending():
                return False
            got = sock.recv_into(view)
        else:
            try:
                got = sock.recv_into(view)  # non-blocking (connect): what is there now
            except BlockingIOError:
                return False
        self._count(need, got)
        return True

    def _count(self, need: int, got: int) -> None:
        if need and not got:
            expected = HEADER_SIZE + (self._header.body_len if self._header is not None else 0)
            done = self._got + (HEADER_SIZE if self._header is not None else 0)
            raise StreamClosed("frame", done, expected)
        self._got += got

    def next_frame(self, max_payload: int) -> tuple[Frame, int] | None:
        if self._header is None:
            if self._got < HEADER_SIZE:
                return None
            self._header = parse_header(bytes(self._head), max_payload)
            self._body, self._got = bytearray(self._header.body_len), 0
        if self._got < self._header.body_len:
            return None
        header, body = self._header, self._body
        self._header, self._body, self._got = None, None, 0
        return decode_frame(header, body), HEADER_SIZE + header.body_len


def result_payload_bytes(request: Dispatch) -> int:
    """The payload size of the RESULT that answers `request`: its rows times the hidden size in the
    reply codec (exact: one row per routed (token, expert) pair; partial: one per token)."""
    tokens, width = request.hidden.shape  # [T_w, d]
    rows = int(np.count_nonzero(request.top_k_index.numpy() >= 0)) if request.mode == CombineMode.EXACT else tokens
    return get_codec(request.wire_combine).nbytes((rows, width))
