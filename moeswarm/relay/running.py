"""A standing relay (`moeswarm relay`): its server run until a stop signal, with a status line in the
log every STATUS_EVERY_S when something changed (not every minute of a quiet relay)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence

from moeswarm.deadline import within
from moeswarm.relay.server import RelayLimits, RelayServer
from moeswarm.stop_signal import stop_event
from moeswarm.transport.member_cert import Authority

STATUS_EVERY_S = 60.0

log = logging.getLogger("moeswarm.relay")


def run_relay(limits: RelayLimits, authority: Authority | None, host: str, port: int,
              on_listening: Callable[[str, int], None] = lambda host, port: None,
              stop_signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Listen on (host, port), say the bound address to `on_listening`, relay until a stop signal."""
    asyncio.run(_relay(limits, authority, host, port, on_listening, stop_signals))


async def _relay(limits: RelayLimits, authority: Authority | None, host: str, port: int,
                 on_listening: Callable[[str, int], None], stop_signals: Sequence[signal.Signals]) -> None:
    relay = RelayServer(limits, authority)
    bound_host, bound = await relay.start(host, port)
    on_listening(bound_host, bound)
    stop = stop_event(stop_signals)
    serving = asyncio.create_task(relay.serve_forever())
    last = None
    while not stop.is_set():
        try:
            await within(STATUS_EVERY_S, stop.wait())
        except asyncio.TimeoutError:
            idle = relay.idle_counts()
            status = (*vars(relay.stats).values(), len(idle), sum(idle.values()))
            if status != last:  # a line when something changed, not every minute of a quiet relay
                last = status
                stats = relay.stats
                log.info("%d connections, %d pipes, %d workers with %d idle connections; %d spliced, %d refused, "
                         "%d bytes relayed since start", stats.connections, stats.pipes, len(idle), sum(idle.values()),
                         stats.spliced, stats.refused, stats.bytes_relayed)
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
