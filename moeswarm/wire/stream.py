"""Reading and writing frames on a blocking socket (the backbone's side), and `decode_frame` for both sides.

Both sides read the same way: the 24-byte header, checked against the limits before anything
else is read or allocated, then the body, then `decode_frame`. A `ProtocolError` from
`parse_header` means the stream can no longer be trusted (close it); one from `decode_frame`
concerns that frame only (its body was read whole, so the stream is still in step). The worker's
asyncio side, with its deadlines and budgets, is moeswarm/worker/framing.py.

Writing never joins the payload: the header and metadata go out as one buffer and each tensor's
bytes as their own (`sendmsg` / `writelines`).
"""

from __future__ import annotations

import select
import socket
import ssl
import time

from moeswarm.wire.frames import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    Frame,
    Header,
    decode_meta,
    opcode_of,
    parse_header,
)


class StreamClosed(ConnectionError):
    """The peer closed the connection; `partial` bytes of the expected item had arrived."""

    def __init__(self, what: str, partial: int, expected: int):
        super().__init__(f"connection closed after {partial} of {expected} bytes of the {what}")
        self.partial = partial


def decode_frame(header: Header, body: bytes | bytearray | memoryview) -> Frame:
    """A frame from its checked header and whole body; ProtocolError names what is wrong."""
    opcode = opcode_of(header)
    view = memoryview(body)
    meta_bytes = bytes(view[: header.meta_len])
    return Frame(opcode, header.request_id, decode_meta(meta_bytes), view[header.meta_len :], meta_bytes)


# -- blocking sockets (the backbone's side) ---------------------------------------------------


def send_frame(sock: socket.socket, frame: Frame, deadline: float | None = None) -> int:
    """Write a frame with `sendmsg`, no payload copies (one joined write over TLS); return the bytes written.

    On a non-blocking socket a full send buffer is waited on until `deadline` (time.monotonic();
    None: no limit), then socket.timeout."""
    buffers = [memoryview(b).cast("B") for b in frame.encode()]
    total = sum(b.nbytes for b in buffers)
    if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg: one write (encryption copies the bytes anyway)
        sock.sendall(b"".join(buffers))
        return total
    while buffers:
        try:
            sent = sock.sendmsg(buffers)
        except BlockingIOError:  # non-blocking, and the peer has not taken enough yet
            _wait_writable(sock, deadline)
            continue
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers[0].nbytes
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]
    return total


def _wait_writable(sock: socket.socket, deadline: float | None) -> None:
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0 or not select.select([], [sock], [], left)[1]:
        raise socket.timeout("timed out sending a frame: the peer takes no bytes")


def recv_frame(sock: socket.socket, deadline: float | None = None,
               max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[Frame, int]:
    """Read one frame before `deadline` (time.monotonic(); None: no limit).

    The deadline covers the whole frame, not each read: a peer that trickles one byte a second
    cannot hold the caller beyond it (socket.timeout is raised). Returns (frame, bytes read).
    """
    header = parse_header(bytes(_recv_exactly(sock, HEADER_SIZE, deadline, "frame header")), max_payload)
    body = _recv_exactly(sock, header.body_len, deadline, "frame body")
    return decode_frame(header, body), HEADER_SIZE + header.body_len


def _recv_exactly(sock: socket.socket, size: int, deadline: float | None, what: str) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"timed out after {got} of {size} bytes of the {what}")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise StreamClosed(what, got, size)
        got += n
    return buffer
