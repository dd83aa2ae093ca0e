"""A worker reached through a relay (relay://HOST:PORT/NAME), for workers that cannot be dialled.

The link dials the relay, asks for the worker registered as NAME (wire/relay.py), and
once the relay answers "K" the socket is a byte pipe to the worker. From there it is a `TcpLink`:
TLS with the swarm key end to end (the relay sees only ciphertext; a byte it alters fails the
TLS record, the link breaks and the dispatcher fails over), then HELLO and the moeswarm protocol.
Reconnecting dials the relay again, which splices a fresh idle connection of the worker.
"""

from __future__ import annotations

import socket
import ssl
import time

from moeswarm.errors import WorkerError
from moeswarm.wire.relay import (ERROR, OK, ROLE_BACKBONE, RelayError, encode_request, error_text,
                                         parse_error_length, parse_relay_address)
from moeswarm.transport.tcp import TcpLink


class RelayLink(TcpLink):
    def __init__(self, address: str, tls: ssl.SSLContext | None = None):
        """address: relay://HOST:PORT/NAME (ValueError when it is not one)."""
        self.relay_host, self.relay_port, self.name = parse_relay_address(address)
        super().__init__(address, tls)

    def _dial(self, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        where = f"relay {self.relay_host}:{self.relay_port}"
        try:
            sock = socket.create_connection((self.relay_host, self.relay_port), timeout=timeout_s)
        except OSError as error:
            raise WorkerError(self.address, f"cannot connect to {where} ({error.strerror or error}): is it running?") from None
        try:
            sock.sendall(encode_request(ROLE_BACKBONE, self.name))
            status = _read_exactly(sock, 1, deadline)
            if status == ERROR:
                message = error_text(_read_exactly(sock, parse_error_length(_read_exactly(sock, 2, deadline)), deadline))
                raise WorkerError(self.address, f"{where} refused: {message}")
            if status != OK:
                raise WorkerError(self.address, f"{where} answered {status!r}, not {OK!r}: is it a moeswarm relay?")
        except (OSError, EOFError, RelayError) as error:
            sock.close()
            raise WorkerError(self.address, f"{where}: handshake failed ({error or type(error).__name__})") from None
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout_s)  # the TLS handshake that follows gets the whole connect timeout again
        return sock


def _read_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly `size` bytes before `deadline`: never a byte of the pipe that follows the handshake."""
    data = b""
    while len(data) < size:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the relay closed the connection")
        data += chunk
    return data
