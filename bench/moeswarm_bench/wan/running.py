"""A standing WAN emulator (`moeswarm wan`): the proxy, and its control port when asked for, run
until a stop signal, then closed."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence

from moeswarm.errors import MoeSwarmError
from moeswarm.stop_signal import stop_event
from moeswarm_bench.wan.control import ControlServer
from moeswarm_bench.wan.proxy import WanProxy


def run_proxy(proxy: WanProxy, control: tuple[str, int] | None = None,
              on_listening: Callable[[WanProxy, ControlServer | None], None] = lambda proxy, control: None,
              stop_signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Start `proxy` (and a ControlServer on `control`), tell `on_listening`, serve until a stop signal.
    MoeSwarmError when either cannot listen."""
    asyncio.run(_run(proxy, control, on_listening, stop_signals))


async def _run(proxy: WanProxy, listen_control: tuple[str, int] | None,
               on_listening: Callable[[WanProxy, ControlServer | None], None],
               stop_signals: Sequence[signal.Signals]) -> None:
    control = ControlServer(proxy, listen_control) if listen_control else None
    try:
        await proxy.start()
        if control:
            await control.start()
    except OSError as error:
        await proxy.close()
        raise MoeSwarmError(f"cannot listen: {error}") from None
    stop = stop_event(stop_signals)
    on_listening(proxy, control)
    try:
        await stop.wait()
    finally:
        if control:
            await control.close()
        await proxy.close()

