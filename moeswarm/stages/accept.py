"""A stage's accept loop: it never stops while the stage runs.

Out of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM), accept backs off (10 ms, doubling to 250 ms)
and retries, after asking for a quiet connection's descriptor (`free_one`); every failure is
counted per cause (worker/admission.py CountedLog), never logged once per connection. Only the
stage's own close ends it.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable

from moeswarm.stages.outbox import shut
from moeswarm.stages.protocol import error_frame
from moeswarm.wire.stream import send_frame
from moeswarm.worker.admission import CountedLog, error_cause

OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
MAX_BACKOFF_S = 0.25


def accept_forever(listener: Callable[[], socket.socket], closed: threading.Event,
                   admit: Callable[[socket.socket, tuple], None], free_one: Callable[[], None],
                   failures: CountedLog) -> None:
    """Accept on `listener()` until `closed` is set (or the listener is closed); each new
    connection goes to `admit(sock, address)`."""
    backoff = 0.0
    while not closed.is_set():
        try:
            sock, address = listener().accept()
        except OSError as error:
            if closed.is_set() or error.errno == errno.EBADF:
                return
            failures.note(f"accept: {error_cause(error)}")
            if error.errno in OUT_OF_DESCRIPTORS:
                free_one()
            backoff = min(max(backoff * 2, 0.01), MAX_BACKOFF_S)
            time.sleep(backoff)
            continue
        backoff = 0.0
        admit(sock, address)


def refuse(sock: socket.socket, message: str) -> None:
    """One ERROR line to a connection over the limits, if it fits the send buffer, then close."""
    try:
        sock.setblocking(False)
        send_frame(sock, error_frame("", 0, "busy", message), deadline=time.monotonic())
    except OSError:
        pass
    shut(sock, close=True)
