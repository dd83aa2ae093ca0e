"""`moeswarm serve` in a child process, for benchmarks and tests: start, wait until ready, scrape, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from moeswarm.errors import MoeSwarmError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class ServeProcess:
    def __init__(self, model: str, workers: Sequence[str], *flags: str, env: dict | None = None, threads: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        holders = ["--workers", ",".join(workers)] if workers else []  # none: local mode, or --stages in flags
        command = [sys.executable, "-m", "moeswarm.cli", "serve", "--model", str(model), *holders,
                   "--port", str(self.port), "--threads", str(threads), "--log-level", "warning", *flags]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 180) -> "ServeProcess":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MoeSwarmError(f"serve exited with status {self.process.returncode}: {self.process.stderr.read()[-2000:]}")
            if self.status("/health") == 200:
                return self
            time.sleep(0.3)
        raise MoeSwarmError(f"serve did not become ready within {timeout_s:g} s")

    def status(self, path: str, headers: dict | None = None) -> int | None:
        """The HTTP status of GET `path` (None when nothing answers)."""
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers or {}), timeout=5) as reply:
                return reply.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return None

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Every sample of GET /metrics, summed over labels: {"moeswarm_steps_total": 12.0, ...}."""
        request = urllib.request.Request(self.url + "/metrics", headers=headers or {})
        with urllib.request.urlopen(request, timeout=10) as reply:
            text = reply.read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def stop(self) -> str:
        """Stop it as Ctrl-C would; return what it wrote on stderr."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            _, err = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        return err or ""
