"""Who holds a server's connection slots: a budget over all peers and one per peer address.

Every connection takes a slot from the moment it is accepted (a TLS handshake in progress
included) until it closes. When the table is full, or the newcomer's address holds its share
already, the quietest connection that has been quiet for at least `quiet_s` (no work in flight,
no request that counts as activity) gives its slot up to the newcomer: connections that never
greeted go first, then the one whose last activity is oldest. A silent peer can therefore keep
slots only while nobody else needs them: it cannot lock new backbones out by holding them. A
server decides what counts as activity (the worker: a successful HELLO or a DISPATCH; a PING
renews nothing).

`CountedLog` logs a recurring failure once per cause with a count, never once per connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Slot:
    """One connection's place in the table.

    busy: whether it has work in flight (never evicted then); evict: close it, with this message.
    """

    host: str
    opened: float
    last_active: float
    greeted: bool = False
    busy: Callable[[], bool] = lambda: False
    evict: Callable[[str], None] = lambda message: None
    released: bool = field(default=False, repr=False)


class ConnectionTable:
    """Slots over all peers (`max_connections`) and per peer address (`max_per_peer`)."""

    def __init__(self, max_connections: int, max_per_peer: int, quiet_s: float):
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.quiet_s = quiet_s
        self.slots: set[Slot] = set()
        self.per_host: Counter[str] = Counter()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.slots)

    def admit(self, host: str, what: str = "connection") -> Slot | str:
        """A slot for a new connection from `host` (after evicting a quiet one if need be), or the
        message that refuses it."""
        now = time.monotonic()
        if self.per_host[host] >= self.max_per_peer:
            if not self._evict([s for s in self.slots if s.host == host], now, "from your address"):
                return (f"{self.per_host[host]} connections from your address open (limit {self.max_per_peer} "
                        f"per address); retry later")
        elif len(self.slots) >= self.max_connections:
            if not self._evict(self.slots, now, "in total"):
                return f"{len(self.slots)} {what}s open (limit {self.max_connections}); retry later"
        slot = Slot(host, now, now)
        self.slots.add(slot)
        self.per_host[host] += 1
        return slot

    def release(self, slot: Slot) -> None:
        """The connection is gone (again: nothing)."""
        if slot.released:
            return
        slot.released = True
        self.slots.discard(slot)
        self.per_host[slot.host] -= 1
        if self.per_host[slot.host] <= 0:
            del self.per_host[slot.host]

    def _evict(self, candidates, now: float, scope: str) -> bool:
        quiet = [s for s in candidates if now - s.last_active >= self.quiet_s and not s.busy()]
        if not quiet:
            return False
        victim = min(quiet, key=lambda s: (s.greeted, s.last_active))
        self.release(victim)
        self.evicted += 1
        victim.evict(f"closed to make room for a new connection: quiet for {now - victim.last_active:.0f} s while "
                     f"the connections {scope} are at their limit")
        return True


class CountedLog:
    """Log a recurring event once per cause, then a count per cause at most every `every_s`."""

    def __init__(self, log: logging.Logger, what: str, every_s: float = 60.0):
        self.log, self.what, self.every_s = log, what, every_s
        self.counts: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()
        self._reported_at = time.monotonic()

    def note(self, cause: str) -> None:
        self.counts[cause] += 1
        if self.counts[cause] == 1:
            self.log.warning("%s: %s (further ones are counted, not logged one by one)", self.what, cause)
            return
        self._unreported[cause] += 1
        now = time.monotonic()
        if now - self._reported_at >= self.every_s:
            self.flush(now)

    def tick(self) -> None:
        """Report the counts not reported yet once `every_s` has passed (call it now and then: the last
        events of a burst get their count even when no event follows)."""
        if self._unreported and time.monotonic() - self._reported_at >= self.every_s:
            self.flush()

    def flush(self, now: float | None = None) -> None:
        """Log the counts not reported yet."""
        if self._unreported:
            summary = ", ".join(f"{cause} x {count}" for cause, count in self._unreported.most_common())
            self.log.warning("%s since the last report: %s", self.what, summary)
            self._unreported.clear()
        self._reported_at = time.monotonic() if now is None else now


def error_cause(error: BaseException) -> str:
    """A short, stable description of an accept or handshake error (no peer text, no traceback)."""
    import errno as errno_module

    number = getattr(error, "errno", None)
    name = errno_module.errorcode.get(number) if isinstance(number, int) else None
    reason = getattr(error, "reason", None)  # ssl.SSLError
    if isinstance(reason, str):
        return f"{type(error).__name__} {reason}"
    if name:
        return f"{type(error).__name__} {name}"
    return type(error).__name__


class StreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, which with `paused` reads nothing before the session's TLS
    handshake starts: a ClientHello read by the plain transport would be lost to TLS.

    `take_whole`, when its session sets one, is offered each chunk the transport reads before the
    stream reader gets it: True when it answered the chunk itself (a whole frame at a frame
    boundary: worker/server.py `_whole_frame`), and then the reader never sees those bytes."""

    take_whole: Callable[[bytes], bool] | None = None

    def __init__(self, reader: asyncio.StreamReader, connected, loop: asyncio.AbstractEventLoop, paused: bool):
        super().__init__(reader, connected, loop=loop)
        self._paused_at_start = paused

    def data_received(self, data: bytes) -> None:
        take = self.take_whole
        if take is None or not take(data):
            super().data_received(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._paused_at_start:
            transport.pause_reading()  # before the transport's reader is added (asyncio adds it after this call)
        super().connection_made(transport)


async def handshake(writer: asyncio.StreamWriter, tls, timeout_s: float, failures: CountedLog) -> bool:
    """Run the server side of TLS on an accepted connection (already holding its slot) within
    `timeout_s`; False (failure counted, connection aborted) when it does not complete."""
    plain = writer.transport
    try:
        async with asyncio.timeout(timeout_s):
            await writer.start_tls(tls, ssl_handshake_timeout=timeout_s)
    except (TimeoutError, ConnectionError, OSError) as error:  # ssl.SSLError is an OSError
        cause = "TimeoutError" if isinstance(error, TimeoutError) else error_cause(error)
    except Exception:  # asyncio (3.11) fails so when the connection was closed mid-handshake (evicted)
        cause = "closed during the handshake"
    else:
        return True
    failures.note(f"TLS handshake: {cause}")
    if writer.transport is None:  # left so by a failed start_tls: the writer keeps its own transport to close
        writer._transport = plain
    writer.transport.abort()
    return False


def peer_host(writer: asyncio.StreamWriter) -> str:
    """The peer's address without its port: connections are budgeted per address."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer)


def loop_errors(failures: CountedLog, previous, loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's exception handler: accept failures (out of file descriptors, ...) are counted per
    cause and logged once, not with a traceback each time; anything else goes on as before."""
    if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
        failures.note(f"accept: {error_cause(context.get('exception') or OSError())}")
        return
    callback = getattr(context.get("handle"), "_callback", None)
    if getattr(callback, "__name__", "") == "_start_serving":
        # asyncio's retry of accept after such a failure, run once the server closed (Python 3.11
        # schedules one per failed accept): nothing to serve any more, nothing to report
        failures.note(f"accept retried after close: {error_cause(context.get('exception') or OSError())}")
        return
    if previous is not None:
        previous(loop, context)
    else:
        loop.default_exception_handler(context)
