"""Graceful shutdown: on SIGINT or SIGTERM the server drains before it stops.

Draining, the server still listens: every new POST (and /health) is answered 503 "shutting down"
(serve/guard.py), while the requests already running get up to `--drain-seconds` to end on their
own. The server stops as soon as none is left; at the deadline, every request still queued or
running is ended with an error (Engine.end_all): a stream gets a final error event and then
`data: [DONE]`, a whole answer a 503 in OpenAI's shape. A second signal ends the drain at once,
the same way; a third (SIGINT) is uvicorn's forced exit.

Everything here runs on the event loop's thread (the main thread, where Python runs signal handlers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

DEFAULT_DRAIN_S = 30.0  # serve --drain-seconds
SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Drain:
    """The gateway's drain state: requests being answered, and when the drain began (None: serving)."""

    in_flight: int = 0  # requests past the guard and not yet answered in full (a stream: until its last event)
    since: float | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal starts a drain instead of stopping it (see the module)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_s: float, end_all: Callable[[str], None]):
        """end_all(message): end every queued and running request with `message` (the engine's, once loaded)."""
        super().__init__(config)
        self.drain, self.drain_s, self.end_all = drain, drain_s, end_all

    def handle_exit(self, sig: int, frame) -> None:
        if not self.drain.draining and not self.should_exit:
            self._captured_signals.append(sig)  # uvicorn raises it again once stopped, as for its own exit
            self.drain.since = time.monotonic()
            return
        if not self.should_exit:  # a second signal: the drain ends now (at the next tick)
            self.drain.since = float("-inf")
            self._captured_signals.append(sig)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit:
            if self.drain.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self.drain.since + self.drain_s:
                self.end_all(f"{SHUTTING_DOWN}: this request did not end within the drain ({self.drain_s:g} s)")
                self.should_exit = True  # uvicorn then waits for the answers to go out (timeout_graceful_shutdown)
        return await super().on_tick(counter)
