"""Whether a worker can listen where it was asked to, found before it spends time loading experts."""

from __future__ import annotations

import errno
import logging
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


FILES_BESIDES_CONNECTIONS = 256  # the model's files, torch's, logs: what a worker opens besides sockets


def raise_open_files_limit(max_connections: int) -> None:
    """Raise the soft open-files limit to what `max_connections` needs (up to the hard limit); warn when short.

    A plain TCP connection holds two descriptors: the transport's and the one the compute thread
    sends RESULTs on (worker/session.py).

    Without it a flood of connections exhausts file descriptors before --max-connections is
    reached, and accept fails for everyone, well-behaved backbones included.
    """
    try:
        import resource
    except ImportError:  # not POSIX
        return
    want = 2 * max_connections + FILES_BESIDES_CONNECTIONS  # each connection: its socket and the compute thread's duplicate
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < want:
        logging.getLogger("moeswarm.worker").warning(
            "open-files limit %d is below the %d that --max-connections %d needs: lower --max-connections or "
            "raise the limit (ulimit -n)", soft, want, max_connections)
