"""`moeswarm bench flood --handshakes N`: silent connections against a keyed worker, and a backbone's wait.

One `moeswarm worker` with a swarm key (TLS) holds every expert of the bundled model. `count`
TCP connections open and never start TLS (or send anything); meanwhile a keyed backbone connects
and greets, from the flood's own address (127.0.0.1) and from another one (127.0.0.2), again and
again. Reported: the worker's open file descriptors (peak, end) and RSS at the end, each backbone's connect +
TLS + HELLO times (median, worst, failures), and the lines the worker logged.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from moeswarm.transport.tls import client_context, write_swarm_key
from moeswarm.wire.frames import Opcode
from moeswarm.wire.messages import Hello
from moeswarm.wire.stream import recv_frame, send_frame

WAIT_S = 30.0


def run_handshake_flood(count: int = 1100, hold_s: float = 15.0, model: str | None = None) -> dict:
    from moeswarm.bundled import demo_model
    from moeswarm.sources.source import open_source

    model = str(model or demo_model())
    fingerprint = open_source(model).fingerprint
    with tempfile.TemporaryDirectory() as tmp:
        key = write_swarm_key(Path(tmp) / "swarm.key")
        log_path = Path(tmp) / "worker.err"
        with open(log_path, "w") as err:
            process = subprocess.Popen(
                [sys.executable, "-m", "moeswarm.cli", "worker", "--model", model, "--port", "0", "--threads", "1",
                 "--swarm-key", str(key)], stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = process.stdout.readline()
            host, port = line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)
            address = (host, int(port))
            worker = psutil.Process(process.pid)
            before = worker.num_fds()
            flood, refused = [], 0
            for _ in range(count):
                try:
                    flood.append(socket.create_connection(address, timeout=WAIT_S))
                except OSError:
                    refused += 1
            times: dict[str, list[float]] = {"same_address": [], "other_address": []}
            failures = {"same_address": 0, "other_address": 0}
            deadline, fds_peak = time.monotonic() + hold_s, worker.num_fds()
            while time.monotonic() < deadline:
                fds_peak = max(fds_peak, worker.num_fds())
                for name, source in (("same_address", "127.0.0.1"), ("other_address", "127.0.0.2")):
                    took = _greet(address, source, key, fingerprint)
                    if took is None:
                        failures[name] += 1
                    else:
                        times[name].append(took)
                time.sleep(0.2)
            fds_end = worker.num_fds()
            rss_mb = worker.memory_info().rss / 2**20
            for sock in flood:
                with contextlib.suppress(OSError):
                    sock.close()
        finally:
            process.terminate()
            process.wait(timeout=20)
        logged = log_path.read_text().splitlines()
    result = {"silent_connections": count, "hold_s": hold_s, "worker_fds_before": before,
              "worker_fds_peak": fds_peak, "worker_fds_end": fds_end, "worker_rss_mb": round(rss_mb, 1), "flood_connects_refused": refused}
    for name, values in times.items():
        result[f"{name}_greet_ms_p50"] = round(statistics.median(values) * 1e3, 1) if values else None
        result[f"{name}_greet_ms_max"] = round(max(values) * 1e3, 1) if values else None
        result[f"{name}_greets"] = len(values)
        result[f"{name}_failed"] = failures[name]
    result["worker_log_lines"] = len(logged)
    result["worker_tracebacks"] = sum("Traceback" in line for line in logged)
    result["worker_log"] = [line.split(" ", 2)[-1] for line in logged[:6]]
    return result


def _greet(address, source: str, key, fingerprint: str) -> float | None:
    """Seconds for connect + TLS + HELLO from `source`; None when refused or failed."""
    started = time.perf_counter()
    try:
        raw = socket.socket()
        raw.settimeout(WAIT_S)
        raw.bind((source, 0))
        raw.connect(address)
        with client_context(key).wrap_socket(raw) as sock:
            send_frame(sock, Hello(fingerprint).to_frame(1))
            reply, _ = recv_frame(sock, time.monotonic() + WAIT_S)
            if reply.opcode != Opcode.HELLO:
                return None
    except (OSError, EOFError):
        return None
    return time.perf_counter() - started
