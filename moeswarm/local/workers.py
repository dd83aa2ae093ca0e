"""Worker subprocesses on this machine, for the demo, gate, benchmarks and tests.

`local_workers` starts `moeswarm worker` processes and yields their addresses; `local_swarm`
also connects a backbone to them. Both stop everything they started on the way out.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

from moeswarm.errors import MoeSwarmError
from moeswarm.model.experts import num_experts_in_config, split_experts
from moeswarm.sources.source import open_source
from moeswarm.ids import format_ids
from moeswarm.swarm import open_swarm

START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def local_workers(model: str, expert_sets: Sequence[Sequence[int]], host: str = "127.0.0.1",
                  extra_args: Sequence[str] = ()) -> Iterator[list[str]]:
    """Start one `moeswarm worker` per expert set; yield their addresses; stop them all.

    Each worker gets one torch thread: several processes share this machine's cores, and idle
    OpenMP threads spinning in one process would steal the others' time.
    """
    processes = []
    try:
        for experts in expert_sets:
            processes.append(spawn_worker(model, experts, host, 0, extra_args))
        yield [wait_listening(process) for process in processes]
    finally:
        stop(processes)


def spawn_worker(model: str, experts: Sequence[int], host: str = "127.0.0.1", port: int = 0,
                 extra_args: Sequence[str] = (), threads: int = 1) -> subprocess.Popen:
    """Start one `moeswarm worker` process (not yet listening: see `wait_listening`)."""
    command = [sys.executable, "-m", "moeswarm.cli", "worker", "--model", str(model), "--experts", format_ids(experts),
               "--host", host, "--port", str(port), "--threads", str(threads), *extra_args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop(processes: Sequence[subprocess.Popen]) -> None:
    """Terminate the processes (kill those that linger)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


@contextlib.contextmanager
def local_swarm(model: str, workers: int | Sequence[Sequence[int]] = 2, **swarm_options):
    """A backbone connected to local worker processes: `workers` is a count (an even split of
    the experts) or the expert sets themselves. Yields the open `Swarm`; closes everything."""
    if isinstance(workers, int):
        workers = split_experts(num_experts_in_config(open_source(model).config), workers)
    with local_workers(model, workers) as addresses, open_swarm(model, addresses, **swarm_options) as swarm:
        yield swarm


def replicated_split(num_experts: int, workers: int, copies: int = 2) -> list[list[int]]:
    """Expert sets in which every expert is held by `copies` workers: the experts cut into
    `workers` slices, worker i holding slices i, i+1, ... (mod workers). 2 workers: both hold all."""
    if not 1 <= copies <= workers:
        raise MoeSwarmError(f"cannot hold {copies} copies of each expert on {workers} workers")
    slices = split_experts(num_experts, workers)
    return [sorted({e for c in range(copies) for e in slices[(i + c) % workers]}) for i in range(workers)]


def wait_listening(process: subprocess.Popen) -> str:
    """The address a started worker listens on, once it says so."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise MoeSwarmError(f"worker exited before listening: {process.stderr.read().strip()[-2000:]}")
        if "listening on " in line:
            return line.split("listening on ", 1)[1].split()[0]
    raise MoeSwarmError(f"worker did not start within {START_TIMEOUT_S:.0f} s")
