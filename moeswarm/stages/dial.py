"""Reaching a stage: connect, TLS when keyed, HELLO, its answer (the gateway's and a stage's side alike)."""

from __future__ import annotations

import socket
import ssl
import time

from moeswarm.errors import ProtocolError, printable
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

DialError = (OSError, ValueError, ProtocolError, ssl.SSLError)  # what `dial` raises when the stage is not had


def dial(address: str, hello: dict, tls: ssl.SSLContext | None, timeout_s: float) -> tuple[socket.socket, Frame]:
    """A connected socket to the stage at HOST:PORT and its HELLO answer; one of DialError otherwise
    (a refusal is a ProtocolError carrying the stage's message)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        send_frame(sock, Frame(Opcode.HELLO, 0, hello))
        reply, _ = recv_frame(sock, time.monotonic() + timeout_s, max_payload=1 << 16)
        if reply.opcode != Opcode.HELLO:
            raise ProtocolError(f"refused: {printable(str(reply.meta.get('message')), 300)}")
    except BaseException:
        sock.close()
        raise
    return sock, reply


def hello_layers(reply: Frame) -> range | None:
    """The span of decoder layers a stage's HELLO answer names (`layers: [first, last]`), or None when malformed."""
    layers = reply.meta.get("layers")
    if not (isinstance(layers, list) and len(layers) == 2 and all(type(v) is int for v in layers)
            and 0 <= layers[0] <= layers[1] < 1 << 20):
        return None
    return range(layers[0], layers[1] + 1)
