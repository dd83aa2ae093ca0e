"""Stage processes on this machine, for tests and benchmarks: `moeswarm stage` per span."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence

from moeswarm.local.workers import stop, wait_listening


def spawn_stage(model: str, span: str, workers: Sequence[str] = (), port: int = 0, threads: int = 1,
                extra_args: Sequence[str] = ()) -> subprocess.Popen:
    """Start one `moeswarm stage --layers SPAN` (its experts on `workers`, or local without any)."""
    holders = ["--workers", ",".join(workers)] if workers else []
    command = [sys.executable, "-m", "moeswarm.cli", "stage", "--model", str(model), "--layers", span, *holders,
               "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads), *extra_args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@contextlib.contextmanager
def local_stages(model: str, spans: Sequence[str], workers: Sequence[Sequence[str]] | None = None, threads: int = 1,
                 extra_args: Sequence[str] = ()):
    """Yields the addresses of one stage process per span ("A-B"), in order; stage i's experts on
    `workers[i]` (none: held by the stage itself)."""
    processes = []
    try:
        for i, span in enumerate(spans):
            processes.append(spawn_stage(model, span, workers[i] if workers else (), threads=threads,
                                         extra_args=extra_args))
        yield [wait_listening(process) for process in processes]
    finally:
        stop(processes)
