"""One persistent TCP connection from the backbone to a worker.

Blocking sockets, on purpose: the model's forward is synchronous, and sending every worker its
frame before reading any reply already gives a parallel star (replies wait in the kernel's
buffers); no event loop or thread hop sits on the per-layer hot path.
"""

from __future__ import annotations

import socket
import time

from moeswarm.errors import ProtocolError, WorkerError
from moeswarm.ids import WorkerAddress, parse_address
from moeswarm.wire.frames import HEADER_SIZE, Frame, Opcode, decode_meta, opcode_of, parse_header
from moeswarm.wire.messages import ErrorReply, Hello, WorkerInfo

CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 120.0


class WorkerConnection:
    def __init__(self, address: str):
        self.address = WorkerAddress(address)
        self._sock: socket.socket | None = None
        self._next_id = 1
        self.info: WorkerInfo | None = None

    def connect(self, fingerprint: str) -> WorkerInfo:
        """Open the connection and exchange HELLO; the worker must serve the same model."""
        try:
            host, port = parse_address(self.address)
        except ValueError as error:
            raise WorkerError(self.address, str(error)) from None
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as error:
            raise WorkerError(self.address, f"cannot connect ({error.strerror or error}): is the worker running?") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(REPLY_TIMEOUT_S)
        self._sock = sock
        request_id = self.send(Hello(fingerprint).to_frame(self.new_request_id()))[0]
        reply, _ = self.receive(request_id)
        self.info = WorkerInfo.from_frame(reply)
        return self.info

    def new_request_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def send(self, frame: Frame) -> tuple[int, int]:
        """Send a frame; return (request id, bytes written to the socket)."""
        buffers = frame.encode()
        try:
            self._require().sendall(b"".join(buffers) if len(buffers) > 1 else buffers[0])
        except OSError as error:
            raise WorkerError(self.address, f"connection lost while sending ({error})") from None
        return frame.request_id, sum(len(b) for b in buffers)

    def receive(self, request_id: int) -> tuple[Frame, int]:
        """Read the reply to `request_id`; an ERROR reply raises WorkerError with its message."""
        head = self._read(HEADER_SIZE)
        try:
            header = parse_header(head)
            body = self._read(header.body_len)
            frame = Frame(opcode_of(header), header.request_id, decode_meta(body[: header.meta_len]), memoryview(body)[header.meta_len :])
        except ProtocolError as error:
            raise WorkerError(self.address, f"bad reply: {error}") from None
        if frame.opcode == Opcode.ERROR:
            raise WorkerError(self.address, ErrorReply.from_frame(frame).message)
        if frame.request_id != request_id:
            raise WorkerError(self.address, f"reply to request {frame.request_id}, expected {request_id}")
        return frame, HEADER_SIZE + header.body_len

    def ping(self) -> float:
        """Round-trip time of a PING, in seconds."""
        start = time.perf_counter()
        request_id = self.send(Frame(Opcode.PING, self.new_request_id()))[0]
        self.receive(request_id)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise WorkerError(self.address, "not connected")
        return self._sock

    def _read(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        sock = self._require()
        while got < size:
            try:
                n = sock.recv_into(view[got:])
            except OSError as error:
                raise WorkerError(self.address, f"connection lost while reading ({error})") from None
            if n == 0:
                raise WorkerError(self.address, "connection closed by the worker (is it down?)")
            got += n
        return buffer
