"""Frames for one peer, sent by a thread of the peer's own: nobody else ever waits on its reading.

`put` only queues (encoded once), never blocks: a peer whose unsent frames would pass `max_bytes`,
or whose oldest unsent frame has waited `send_timeout_s` (`stalled`, checked by the caller's
housekeeping), has its outbox failed: the socket is shut, and `on_fail` gets the frames it never
took, in one call. With `connect` (an onward link), the thread dials first, off the caller's
thread, and a dial that fails fails the outbox the same way.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable

from moeswarm.wire.frames import Frame
from moeswarm.wire.stream import send_frame

Fail = Callable[[str, list[Frame]], None]


def frame_bytes(frame: Frame) -> int:
    return sum(memoryview(part).nbytes for part in frame.encode())


class Outbox:
    def __init__(self, name: str, max_bytes: int, send_timeout_s: float, on_fail: Fail,
                 sock: socket.socket | None = None, connect: Callable[[], socket.socket] | None = None):
        """sock: a connection whose reader thread closes it (a failure only shuts it); connect: how to
        dial the peer (an onward link: this outbox owns the socket and closes it)."""
        self.name, self.max_bytes, self.send_timeout_s = name, max_bytes, send_timeout_s
        self.sock, self._connect, self._on_fail = sock, connect, on_fail
        self._frames: collections.deque[tuple[Frame, int, float]] = collections.deque()  # (frame, bytes, queued at)
        self.unsent = 0  # bytes queued or being sent
        self.failed: str | None = None
        self.last_used = time.monotonic()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, frame: Frame) -> bool:
        """Queue `frame` (False: the outbox has failed, now or before; the frame is dropped and not reported)."""
        size = frame_bytes(frame)
        with self._cond:
            if self.failed is not None:
                return False
            if self.unsent + size > self.max_bytes and self.unsent > 0:
                reason = f"its unsent frames passed {self.max_bytes} bytes: it does not read"
            else:
                self._frames.append((frame, size, time.monotonic()))
                self.unsent += size
                self.last_used = time.monotonic()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"moeswarm-stage-send-{self.name}",
                                                    daemon=True)
                    self._thread.start()
                self._cond.notify()
                return True
        self.fail(reason)
        return False

    def stalled(self, now: float) -> bool:
        """Whether its oldest unsent frame has waited past `send_timeout_s`."""
        with self._cond:
            return bool(self._frames) and now - self._frames[0][2] > self.send_timeout_s

    def fail(self, reason: str) -> None:
        """Stop: shut the socket, drop what is unsent (reported once to `on_fail`)."""
        with self._cond:
            if self.failed is not None:
                return
            self.failed = reason
            dropped = [frame for frame, _, _ in self._frames]
            self._frames.clear()
            self.unsent = 0
            self._cond.notify()
        shut(self.sock, close=self._connect is not None)
        self._on_fail(reason, dropped)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._frames and self.failed is None:
                    self._cond.wait()
                if self.failed is not None:
                    return
                frame, size, _ = self._frames[0]
            try:
                if self.sock is None:
                    self.sock = self._connect()
                    if self.failed is not None:  # failed while dialing
                        shut(self.sock, close=True)
                        return
                send_frame(self.sock, frame)
            except Exception as error:  # noqa: BLE001: a dial or a send failing is the peer's, said in one line
                from moeswarm.errors import one_line

                self.fail(one_line(error))
                return
            with self._cond:
                if self._frames and self._frames[0][0] is frame:
                    self._frames.popleft()
                    self.unsent -= size
                self.last_used = time.monotonic()


def shut(sock: socket.socket | None, close: bool = False) -> None:
    """Shut a socket another thread may be blocked on (closing alone does not wake it); close it too
    when no other thread will (`close`)."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if close:
        try:
            sock.close()
        except OSError:
            pass
