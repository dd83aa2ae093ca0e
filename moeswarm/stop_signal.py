"""How a long-running command learns it should stop: an asyncio Event set by the stop signals."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence


def stop_event(stop_signals: Sequence[signal.Signals]) -> asyncio.Event:
    """An Event the running loop sets when one of `stop_signals` arrives (call inside the loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in stop_signals:
        loop.add_signal_handler(sig, stop.set)
    return stop
