"""What a slow or hostile HTTP client may hold: deadlines on reading a request, a connection cap,
and no secret in the access log.

uvicorn has no deadline on a request's headers or body (a client sending a byte every few seconds
holds its connection for ever) and no cap on open connections; `limited_protocol` adds both to its
h11 protocol. Deadlines: a request's headers within `header_s` of the connection (or of the previous
response on a kept-alive connection), its body within `body_s` more; a client that misses one is
disconnected. A connection past `max_connections` is closed as soon as it is accepted.
"""

from __future__ import annotations

import asyncio
import logging
import re

from uvicorn.protocols.http.h11_impl import H11Protocol

SECRET_QUERY = re.compile(r"(?i)([?&](?:api_key|api-key|key|token|access_token)=)[^&\s\"]*")


def limited_protocol(header_s: float, body_s: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) with these limits."""

    class LimitedProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _body_time_given = False

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()  # over the cap: nothing read, nothing held
                return
            self._arm(header_s)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._body_time_given = False
            self._arm(header_s)  # the next request's headers, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

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
