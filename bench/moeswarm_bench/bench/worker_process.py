"""A `moeswarm worker` process for the fuzzer, the flood bench and the limit tests.

Unlike `moeswarm.local.workers`, this imports nothing of the backbone: the worker side is tested
and measured on its own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import format_ids

START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def spawn_worker(model: str, experts: Sequence[int], extra_args: Sequence[str] = (),
                 start_timeout_s: float = START_TIMEOUT_S, threads: int = 1
                 ) -> Iterator[tuple[tuple[str, int], subprocess.Popen]]:
    """One `moeswarm worker` process (`threads` torch threads) serving `experts`: yields ((host, port), process)."""
    command = [sys.executable, "-m", "moeswarm.cli", "worker", "--model", str(model), "--experts", format_ids(experts),
               "--port", "0", "--threads", str(threads), *extra_args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            line = process.stdout.readline()
            if not line:
                raise MoeSwarmError(f"worker exited before listening (exit code {process.wait()})")
            if "listening on " in line:
                host, port = line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)
                break
            if time.monotonic() > deadline:
                raise MoeSwarmError(f"worker did not start within {start_timeout_s:.0f} s")
        yield (host, int(port)), process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
