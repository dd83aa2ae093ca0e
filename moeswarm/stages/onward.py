"""A stage's links to the next stages of its sessions' routes.

A next hop is the address its session's gateway named at HELLO (stages/sessions.py), reached on
one link per endpoint: `canonical` folds every spelling of one address into one key (`127.1`,
`0x7f000001`, `2130706433` and `127.0.0.1` are one IPv4 address; names are lower-cased), so
respellings share a link instead of opening one each. A link dials on its own thread (never the
compute thread's) and counts as up only once the far side answered HELLO as a stage of the same
model whose layers start where this stage's end. At most `max_links` are open (the least recently
used one is closed for a new one), a link unused for `idle_s` is closed, and a link whose peer
stops reading fails (outbox.py): its unsent steps are reported to `on_fail`, one ERROR per session.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass

from moeswarm.errors import ProtocolError, printable
from moeswarm.stages.dial import dial, hello_layers
from moeswarm.stages.outbox import Outbox
from moeswarm.wire.frames import Frame

HOSTNAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?)*$")


@dataclass(frozen=True)
class OnwardLimits:
    max_links: int = 16
    idle_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_unsent_bytes: int = 256 << 20  # one link's steps not yet taken by the next stage
    send_timeout_s: float = 30.0


def canonical(address: str) -> str:
    """HOST:PORT in one spelling per endpoint ("[v6]:PORT" for IPv6); ValueError naming what is wrong."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{printable(address, 80)} is not HOST:PORT")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None and ":" not in host:
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(host))  # every spelling inet_aton takes: 127.1, 0x7f000001
        except OSError:
            ip = None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv6Address):
        return f"[{ip.compressed}]:{int(port)}"
    if ip is not None:
        return f"{ip}:{int(port)}"
    name = host.lower().rstrip(".")
    if len(name) > 253 or not HOSTNAME.match(name):
        raise ValueError(f"{printable(address, 80)}: {printable(host, 60)} is neither an IP address nor a host name")
    return f"{name}:{int(port)}"


def dial_host(key: str) -> str:
    """The host part of a canonical address as `dial` takes it (HOST:PORT, IPv6 without brackets)."""
    host, _, port = key.rpartition(":")
    return f"{host.strip('[]')}:{port}"


class OnwardLinks:
    """Links to next stages, keyed by canonical address. `on_fail(reason, frames)`: frames a link never delivered."""

    def __init__(self, fingerprint: str, first_layer: int, tls: ssl.SSLContext | None, limits: OnwardLimits,
                 on_fail: Callable[[str, str, list[Frame]], None]):
        self.fingerprint, self.first_layer, self.tls, self.limits = fingerprint, first_layer, tls, limits
        self._on_fail = on_fail
        self._links: dict[str, Outbox] = {}
        self._lock = threading.Lock()
        self.dials = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for link in self._links.values() if link.failed is None)

    def send(self, address: str, frame: Frame) -> None:
        """Queue `frame` for the stage at `address` (never blocks); a failure reaches `on_fail`."""
        try:
            key = canonical(address)
        except ValueError as error:
            self._on_fail(address, str(error), [frame])
            return
        with self._lock:
            link = self._links.get(key)
            if link is None or link.failed is not None:
                link = self._open(key)
        if not link.put(frame):
            self._on_fail(key, f"the link to {key} failed: {link.failed}", [frame])

    def expire(self, now: float) -> None:
        """Close links unused for `idle_s`, and fail those whose peer stopped reading."""
        with self._lock:
            links = list(self._links.items())
        for key, link in links:
            if link.stalled(now):
                link.fail(f"the next stage took no bytes for {self.limits.send_timeout_s:g} s")
            elif link.unsent == 0 and now - link.last_used > self.limits.idle_s:
                link.fail("idle")
            if link.failed is not None:
                with self._lock:
                    if self._links.get(key) is link:
                        del self._links[key]

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.fail("the stage is closing")

    def check(self, check: Callable[[socket.socket], None]) -> None:
        """Run `check` on each connected link's socket; a link it raises for fails."""
        with self._lock:
            links = list(self._links.values())
        for link in links:
            if link.sock is not None and link.failed is None:
                try:
                    check(link.sock)
                except Exception as error:  # noqa: BLE001: the check's refusal, in one line
                    link.fail(str(error))

    def _open(self, key: str) -> Outbox:
        """A new link (the lock held); past `max_links`, the least recently used one is closed first."""
        live = {k: v for k, v in self._links.items() if v.failed is None}
        while len(live) >= self.limits.max_links:
            oldest = min(live, key=lambda k: live[k].last_used)
            threading.Thread(target=live.pop(oldest).fail, args=("closed to make room for another next stage",),
                             daemon=True).start()  # its failure callbacks run without this lock
        self._links = live
        link = Outbox(key, self.limits.max_unsent_bytes, self.limits.send_timeout_s,
                      lambda reason, frames: self._on_fail(key, reason, frames), connect=lambda: self._dial(key))
        self._links[key] = link
        return link

    def _dial(self, key: str) -> socket.socket:
        self.dials += 1
        hello = {"role": "stage", "fingerprint": self.fingerprint}
        sock, reply = dial(dial_host(key), hello, self.tls, self.limits.connect_timeout_s)
        layers = hello_layers(reply)
        if reply.meta.get("fingerprint") != self.fingerprint or layers is None or layers.start != self.first_layer:
            sock.close()
            raise ProtocolError(f"{key} is not a stage of this model holding layer {self.first_layer} next")
        sock.settimeout(self.limits.send_timeout_s)  # a step not sent whole within it fails the link
        return sock
