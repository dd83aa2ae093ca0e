"""hivemind's DHT process, made to end with the process that started it.

hivemind runs a DHT node in a forked process, which starts the libp2p daemon (p2pd). When the
process that started them is killed outright (SIGKILL, the OOM killer), neither notices: both
would live on as orphans; and a SIGTERM to the DHT process (multiprocessing's exit handler sends
one) would orphan p2pd. Here the forked process watches its parent and, when it is gone or on
SIGTERM, kills its own children (p2pd) and exits.

This module imports hivemind: import it only where `--swarm` is used (discovery/dht.py does).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
from hivemind.dht import DHT

WATCH_S = 0.5


class WatchedDHT(DHT):
    def __init__(self, *args, **kwargs):
        self._starter_pid = os.getpid()  # before the fork: the process to outlive nothing of
        super().__init__(*args, **kwargs)

    def run(self) -> None:  # in the forked process
        signal.signal(signal.SIGTERM, lambda *_: _end())
        threading.Thread(target=_end_with, args=(self._starter_pid,), name="moeswarm-dht-watch", daemon=True).start()
        super().run()


def _end_with(starter_pid: int) -> None:
    while os.getppid() == starter_pid:
        time.sleep(WATCH_S)
    _end()


def _end() -> None:
    """Kill this process's children (p2pd, started by it) and exit at once."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(0)
