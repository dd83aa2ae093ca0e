"""One connection from a gateway to one stage (`StageLink`), and the words of a route (`parse_route`).

A link says HELLO (the gateway's session and its place in the chain), checks the stage's answer
(its layers, how it keeps its keys and values), then a reader thread hands every frame to its
chain (stages/client.py), and a lost connection too.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING

from moeswarm.errors import MoeSwarmError, ProtocolError, one_line, printable
from moeswarm.stages.dial import DialError, dial, hello_layers
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

if TYPE_CHECKING:
    from moeswarm.stages.client import Chain

CONNECT_TIMEOUT_S = 10.0
MAX_TOKENS = 1 << 16  # the most rows a result may carry back (a step never sends more)


class StageError(MoeSwarmError):
    """A stage failed a step (its one-line reason), or a stage could not be reached."""


def parse_route(text: str) -> list[list[str]]:
    """`--stages H:P,H:P|H2:P2,...` -> per position in layer order, its replicas (H:P|H2:P2: the
    same layers twice, the second used when the first fails)."""
    positions = [[r.strip() for r in part.split("|") if r.strip()] for part in text.split(",") if part.strip()]
    if not positions or not all(positions):
        raise ValueError("give at least one stage, HOST:PORT (replicas of one span joined by |)")
    for address in (a for replicas in positions for a in replicas):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"stage {address!r} is not HOST:PORT")
    return positions


class StageLink:
    """One connection to one stage: HELLO, then a reader thread resolving the chain's futures."""

    def __init__(self, address: str, chain: "Chain"):
        self.address, self.chain = address, chain
        self.layers: range | None = None
        self.dead = False  # its connection was lost
        self._sock: socket.socket | None = None
        self._send = threading.Lock()

    def connect(self, session: str, fingerprint: str, tls: ssl.SSLContext | None, links: dict | None = None) -> None:
        """links: the session's place in its chain, for the stage's HELLO (`upstream`, `onward`,
        `onward_token`: stages/sessions.py)."""
        hello = {"role": "gateway", "session": session, "fingerprint": fingerprint, **(links or {})}
        try:
            sock, reply = dial(self.address, hello, tls, CONNECT_TIMEOUT_S)
        except DialError as error:
            raise StageError(f"stage {self.address}: cannot connect: {one_line(error)}") from None
        self.layers = hello_layers(reply)
        if self.layers is None:
            sock.close()
            raise StageError(f"stage {self.address} answered HELLO without its layers")
        kept = reply.meta.get("kv_cache", "model")
        if kept != self.chain.kv_cache:
            sock.close()
            raise StageError(f"stage {self.address} keeps its keys and values as {printable(str(kept), 20)}, this "
                             f"gateway as {self.chain.kv_cache}: start both with the same --kv-cache")
        sock.settimeout(None)
        self._sock = sock
        threading.Thread(target=self._read, name=f"moeswarm-stage-{self.address}", daemon=True).start()

    def send(self, frame: Frame) -> None:
        with self._send:
            send_frame(self._sock, frame)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()

    def _read(self) -> None:
        try:
            while True:
                frame, _ = recv_frame(self._sock, None, max_payload=MAX_TOKENS * self.chain.hidden_size * 4 + 4096)
                self.chain.receive(self, frame)
        except (OSError, ProtocolError, ConnectionError, ValueError) as error:
            self.dead = True
            self.chain.lost(self, one_line(error))

    def answers_ping(self, timeout_s: float = 2.0) -> bool:
        """Whether the stage answers a PING on a fresh connection within `timeout_s` (not stalled)."""
        try:
            sock, _ = dial(self.address, {"role": "stage", "fingerprint": self.chain.fingerprint}, self.chain.tls,
                           timeout_s)
            with sock:
                send_frame(sock, Frame(Opcode.PING, 1))
                reply, _ = recv_frame(sock, time.monotonic() + timeout_s, max_payload=1 << 16)
                return reply.opcode == Opcode.PONG
        except DialError:
            return False
