"""Worker subprocesses on this machine, for the demo, tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from moeswarm.errors import MoeSwarmError

START_TIMEOUT_S = 120.0


def split_experts(num_experts: int, workers: int) -> list[tuple[int, int]]:
    """Disjoint contiguous ranges covering 0..num_experts-1, as even as possible."""
    if not 1 <= workers <= num_experts:
        raise MoeSwarmError(f"cannot split {num_experts} experts over {workers} workers")
    bounds = [round(i * num_experts / workers) for i in range(workers + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(workers)]


@contextlib.contextmanager
def local_workers(model: str, ranges: list[tuple[int, int]], host: str = "127.0.0.1",
                  extra_args: list[str] | None = None) -> Iterator[list[str]]:
    """Start one `moeswarm worker` per expert range; yield their addresses; stop them all.

    Each worker gets one torch thread: several processes share this machine's cores, and idle
    OpenMP threads spinning in one process would steal the others' time.
    """
    processes = []
    try:
        for low, high in ranges:
            command = [sys.executable, "-m", "moeswarm.cli", "worker", "--model", str(model),
                       "--experts", f"{low}-{high}", "--host", host, "--port", "0", "--threads", "1",
                       *(extra_args or [])]
            processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        yield [_wait_listening(process) for process in processes]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_listening(process: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise MoeSwarmError(f"worker exited before listening: {process.stderr.read().strip()[-2000:]}")
        if "listening on " in line:
            return line.split("listening on ", 1)[1].split()[0]
    raise MoeSwarmError(f"worker did not start within {START_TIMEOUT_S:.0f} s")
