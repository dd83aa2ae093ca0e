"""The path policy: a worker is reached directly when it can be dialled, through its relay otherwise.

A worker is given (on `--workers`, or in a discovery record) as

    HOST:PORT                          direct only
    relay://RELAY:PORT/NAME            through a relay only (it cannot be dialled)
    HOST:PORT+relay://RELAY:PORT/NAME  both: the direct address is probed first

The probe is a PING over a fresh connection (TLS with the swarm key when there is one) with a
short timeout. The direct route costs a hop less (and the relay nothing), so it wins whenever the
worker answers on it; the relay is for workers behind NAT. The chosen kind, "direct" or "relay", is recorded per worker in the accounting.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import time

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import parse_address
from moeswarm.wire.relay import parse_relay_address
from moeswarm.transport.relay import RelayLink
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

PROBE_TIMEOUT_S = 2.0
DIRECT, RELAY = "direct", "relay"


def parse_worker(text: str) -> tuple[str | None, str | None]:
    """(direct address, relay address) of one worker spec; ValueError naming the bad text."""
    text = text.strip()
    direct, plus, relay = text.partition("+")
    if not plus:
        direct, relay = (None, text) if text.startswith("relay://") else (text, "")
    if direct is not None:
        parse_address(direct)
    if relay:
        if not relay.startswith("relay://"):
            raise ValueError(f"bad worker {text!r}: after '+' comes relay://HOST:PORT/NAME")
        parse_relay_address(relay)
    return direct, relay or None


HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?)*")


def canonical_address(text: str) -> str:
    """One spelling per worker spec, so that a record cannot pass for many workers by respelling
    one: IPv4 in dotted decimal (127.1 and 0x7f000001 are 127.0.0.1), IPv6 compressed, host
    names in lower case, ports without leading zeros; both routes of a HOST:PORT+relay:// form.
    ValueError naming the bad text when it is not a worker spec."""
    direct, relay = parse_worker(text)
    parts = []
    if direct is not None:
        parts.append(_canonical_host_port(direct))
    if relay is not None:
        host, port, name = parse_relay_address(relay)
        parts.append(f"relay://{_canonical_host_port(f'{host}:{port}')}/{name}")
    return "+".join(parts)


def _canonical_host_port(text: str) -> str:
    host, port = parse_address(text)
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            host = socket.inet_ntoa(socket.inet_aton(host))  # the old numeric forms: 127.1, 0x7f000001, 0177.0.0.1
        except OSError:
            host = host.lower().rstrip(".")
            if not HOST_NAME.fullmatch(host):
                raise ValueError(f"bad address {text!r}: {host!r} is neither an IP address nor a host name") from None
    return f"{host}:{port}"


def probe(address: str, timeout_s: float, tls: ssl.SSLContext | None = None) -> bool:
    """Whether the worker at `address` answers a PING within `timeout_s` (TCP, TLS with the swarm
    key, PING, PONG; closed at once). More than a TCP connect: a middlebox or another service that
    accepts connections on that address does not pass for the worker."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection(parse_address(address), timeout=timeout_s) as raw:
            sock = tls.wrap_socket(raw) if tls is not None else raw
            send_frame(sock, Frame(Opcode.PING, 1))
            frame, _ = recv_frame(sock, deadline, max_payload=0)
            return frame.opcode == Opcode.PONG and frame.request_id == 1
    except (OSError, ValueError, MoeSwarmError):  # ssl.SSLError and socket.timeout are OSErrors
        return False


def choose_path(direct_address: str | None, relay_address: str | None, probe_timeout_s: float = PROBE_TIMEOUT_S,
                tls: ssl.SSLContext | None = None) -> tuple[str, TcpLink]:
    """("direct" or "relay", the link to use), not yet connected.

    With only one route that one is used, unprobed (its connect reports what is wrong); with both,
    the direct address is used if it accepts a TCP connection within `probe_timeout_s`.
    """
    if direct_address is None and relay_address is None:
        raise ValueError("a worker needs a direct address, a relay address, or both")
    if relay_address is None or (direct_address is not None and probe(direct_address, probe_timeout_s, tls)):
        return DIRECT, TcpLink(direct_address, tls)
    return RELAY, RelayLink(relay_address, tls)


def worker_link(spec: str, probe_timeout_s: float = PROBE_TIMEOUT_S,
                tls: ssl.SSLContext | None = None) -> tuple[str, TcpLink]:
    """`choose_path` for one `--workers` entry; MoeSwarmError when it is not one."""
    try:
        routes = parse_worker(spec)
    except ValueError as error:
        raise MoeSwarmError(str(error)) from None
    return choose_path(*routes, probe_timeout_s, tls)
