"""A standing seeder (`moeswarm seed`): byte ranges of a model file served until a stop signal."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence

from moeswarm.slices.seed import Seeder
from moeswarm.stop_signal import stop_event


def run_seeder(seeder: Seeder, host: str, port: int,
               on_listening: Callable[[str, int], None] = lambda host, port: None,
               stop_signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Listen on (host, port), say the bound address to `on_listening`, serve until a stop signal."""
    asyncio.run(_serve(seeder, host, port, on_listening, stop_signals))


async def _serve(seeder: Seeder, host: str, port: int, on_listening: Callable[[str, int], None],
                 stop_signals: Sequence[signal.Signals]) -> None:
    bound_host, bound = await seeder.start(host, port)
    on_listening(bound_host, bound)
    stop = stop_event(stop_signals)
    await stop.wait()
    await seeder.close()
