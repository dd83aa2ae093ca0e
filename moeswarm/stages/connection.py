"""One peer's connection to a stage: its socket, its slot in the connection table, its outbox, what its HELLO said.

The reader thread (stages/server.py) owns the socket and closes it; anyone may `drop` the
connection (eviction, a HELLO deadline, a revoked member, an outbox that stalled): that shuts the
socket, which ends the reader. Everything sent to the peer goes through its outbox (outbox.py):
the compute thread never waits on a peer's reading.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import time

from moeswarm.stages.outbox import Fail, Outbox, shut
from moeswarm.stages.sessions import Session
from moeswarm.wire.frames import Frame
from moeswarm.worker.admission import Slot


class Connection:
    def __init__(self, sock: socket.socket, peer: str, slot: Slot, max_unsent_bytes: int, send_timeout_s: float,
                 on_fail: Fail):
        self.sock, self.peer, self.slot = sock, peer, slot
        self.opened = time.monotonic()
        self.role: str | None = None  # "gateway" or "stage", once its HELLO was taken
        self.session: Session | None = None  # the session a gateway's HELLO opened
        self.reading_since: float | None = None  # when the frame being read began to arrive
        self.queued = 0  # its steps waiting for the compute thread (the server's lock)
        self.member = member_of(sock)
        self.outbox = Outbox(peer, max_unsent_bytes, send_timeout_s, on_fail, sock=sock)
        self.dropped: str | None = None

    def send(self, frame: Frame) -> bool:
        """Queue `frame` for the peer; False when the connection is failing (the frame is dropped)."""
        return self.outbox.put(frame)

    def drop(self, why: str) -> None:
        """Close the connection from any thread (its reader ends, and cleans up)."""
        if self.dropped is None:
            self.dropped = why
        shut(self.sock)


def member_of(sock: socket.socket) -> str | None:
    """The peer's member certificate, as a short digest (None on plain TCP)."""
    if not isinstance(sock, ssl.SSLSocket):
        return None
    der = sock.getpeercert(binary_form=True)
    return hashlib.sha256(der).hexdigest()[:16] if der else None
