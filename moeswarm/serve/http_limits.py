"""What a slow or hostile HTTP client may hold: deadlines on reading a request, a connection cap,
and no secret in the access log.

uvicorn has no deadline on a request's headers or body (a client sending a byte every few seconds
holds its connection for ever) and no cap on open connections; `limited_protocol` adds both to its
h11 protocol. Deadlines: a request's headers within `header_s` of the connection (or of the previous
response on a kept-alive connection), its body within `body_s` more; a client that misses one is
disconnected.

Connection slots: at most `max_connections`; below the cap anyone gets one. At the cap a newcomer
takes the slot of a connection waiting for a request's headers (a kept-alive idle one, or one
trickling its headers): when its own address holds less than its share (`max_per_address`, a
quarter of the cap unless given) and another address holds more, the one of that address that
has waited longest, however briefly; otherwise the one anywhere that has waited longest, once it
has waited `quiet_s`. With none to take, the newcomer is closed as soon as it is accepted. So a
reconnecting slowloris cannot keep another address out, nor, past `quiet_s`, a client of its own
address that sends its request at once.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

SECRET_QUERY = re.compile(r"(?i)([?&](?:api_key|api-key|key|token|access_token)=)[^&\s\"]*")


def limited_protocol(header_s: float, body_s: float, max_connections: int, max_per_address: int | None = None,
                     quiet_s: float = 1.0) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) with these limits (the module's rules)."""
    per_address = max_per_address or max(1, max_connections // 4)
    slots: dict[str, dict[H11Protocol, None]] = {}  # address -> its connections, in arrival order
    count = [0]

    class LimitedProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _body_time_given = False
        _address: str | None = None
        _waiting_since = 0.0  # since when it has waited for a request's headers

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            address = str(self.client[0]) if self.client else "?"
            if count[0] >= max_connections and not _make_room(address):
                transport.close()  # over the cap: nothing read, nothing held
                return
            self._address, self._waiting_since = address, time.monotonic()
            slots.setdefault(address, {})[self] = None
            count[0] += 1
            self._arm(header_s)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._body_time_given = False
            self._waiting_since = time.monotonic()
            self._arm(header_s)  # the next request's headers, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._release()
            super().connection_lost(exc)

        def _release(self) -> None:
            held = slots.get(self._address)
            if held is not None and self in held:
                del held[self]
                count[0] -= 1
                if not held:
                    del slots[self._address]

        def _waiting(self) -> bool:
            """Whether it waits for a request's headers (none in progress)."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self, seconds: float) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # no (next) request's headers in time
                self.transport.close()
            elif cycle.more_body and not cycle.response_started:  # headers in, body still coming
                if self._body_time_given:
                    self.transport.close()  # the app reading the body sees http.disconnect
                else:
                    self._body_time_given = True
                    self._arm(body_s)

    def _make_room(address: str) -> bool:
        """Close one connection waiting for headers for a newcomer from `address` (the module's rules)."""
        now = time.monotonic()
        if len(slots.get(address, ())) < per_address:
            hogs = [held for other, held in slots.items() if other != address and len(held) > per_address]
            if _evict([p for held in hogs for p in held], now, 0.0):
                return True
        return _evict([p for held in slots.values() for p in held], now, quiet_s)

    def _evict(candidates: list, now: float, waited_s: float) -> bool:
        """Close the candidate that has waited longest (at least `waited_s`) for headers; False when none has."""
        waiting = [p for p in candidates if p._waiting() and now - p._waiting_since >= waited_s]
        if not waiting:
            return False
        victim = min(waiting, key=lambda p: p._waiting_since)
        victim._release()
        victim.transport.close()
        return True

    return LimitedProtocol


class RedactSecrets(logging.Filter):
    """Replaces the value of key=, api_key=, token= in a log line's query strings by REDACTED
    (the dashboard is opened as /?key=KEY, and uvicorn's access log prints the whole path)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.args = tuple(SECRET_QUERY.sub(r"\1REDACTED", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = SECRET_QUERY.sub(r"\1REDACTED", record.msg)
        return True


def redact_access_log() -> None:
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
