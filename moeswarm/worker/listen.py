"""Whether a worker can listen where it was asked to, found before it spends time loading experts."""

from __future__ import annotations

import errno
import socket

from moeswarm.errors import MoeSwarmError


def check_can_listen(host: str, port: int) -> None:
    """Raise MoeSwarmError unless a server could listen on (host, port) now.

    Binds and closes a socket for every address `host` resolves to, with SO_REUSEADDR as asyncio's
    `start_server` sets it: a port left in TIME_WAIT passes, a port another server listens on fails.
    """
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise MoeSwarmError(f"cannot listen on {host}:{port}: unknown host {host!r} ({error.strerror})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                raise MoeSwarmError(_cannot_listen(host, port, error)) from None


def _cannot_listen(host: str, port: int, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use: choose another --port, or --port 0 for any free one"
    return f"cannot listen on {host}:{port}: {error.strerror or error}"
