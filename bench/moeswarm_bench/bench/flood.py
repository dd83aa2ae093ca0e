"""`moeswarm bench flood`: a well-behaved backbone's latency before and during attacks on its worker.

One `moeswarm worker` process holds every expert of a tiny random qwen2_moe. A well-behaved
client (one persistent greeted connection, as a backbone keeps) times PING and small-DISPATCH
round trips, and a fresh connect + HELLO, in each phase:

  idle         nothing else
  unread       `flooders` connections pipeline 512-token DISPATCHes (3.5x replies) and never read
  pipelined    the same connections pipeline and read their replies: the compute thread never rests
  half_open    `half_open` connections that sent 5 bytes of a frame and stall
  idle_conns   `half_open` connections that connected and said nothing

Reported per phase: p50 and p99 (ms) of each round trip, the worker's RSS (MB) at the end of
the phase, RESULTs that differ from the first one (wrong_results) and ERROR replies by code.

`moeswarm bench flood --amplification` runs the reply-amplification attack instead
(bench/amplification.py).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import torch

from moeswarm_bench.bench.worker_process import spawn_worker
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result
from moeswarm.wire.stream import recv_frame, send_frame

WAIT_S = 30.0


def run_flood(half_open: int = 200, flooders: int = 4, samples: int = 300) -> dict:
    from moeswarm.sources.source import open_source
    from moeswarm.model.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model("qwen2_moe", Path(tmp) / "qwen2_moe"))
        fingerprint = open_source(model).fingerprint
        # every client here is on 127.0.0.1: the per-address cap would refuse the floods before they start
        per_peer = ("--max-connections-per-peer", str(half_open + flooders + 16))
        with spawn_worker(model, range(8), per_peer) as (address, process):
            worker = psutil.Process(process.pid)
            client = _Client(address, fingerprint)
            result = {"half_open": half_open, "flooders": flooders, "samples": samples}
            reference = client.reference()
            phases = {"idle": contextlib.nullcontext(), "unread": _flood(address, fingerprint, flooders, read=False),
                      "pipelined": _flood(address, fingerprint, flooders, read=True),
                      "half_open": _stalled(address, half_open, b"MSWM\x02"),
                      "idle_conns": _stalled(address, half_open, b"")}
            for name, attack in phases.items():
                with attack:
                    time.sleep(0.5)  # the attack is under way
                    ping, dispatch, connect = client.measure(samples, reference)
                    result[f"{name}_rss_mb"] = round(worker.memory_info().rss / 2**20, 1)
                for what, times in (("ping", ping), ("dispatch", dispatch), ("connect", connect)):
                    result[f"{name}_{what}_ms_p50"] = round(_percentile(times, 50) * 1e3, 3)
                    result[f"{name}_{what}_ms_p99"] = round(_percentile(times, 99) * 1e3, 3)
            result["wrong_results"] = client.wrong
            result["error_replies"] = dict(client.errors)
            client.close()
    return result


class _Client:
    """A well-behaved backbone: one persistent connection; checks every RESULT."""

    def __init__(self, address, fingerprint: str):
        self.address, self.fingerprint = address, fingerprint
        self.sock = self._greeted()
        generator = torch.Generator().manual_seed(0)
        ids = torch.tensor([[0, 5], [3, 1], [7, 2], [6, 4]])  # [T=4, k=2]: a decode step of 4 sequences
        self.request = Dispatch(0, torch.randn(4, 32, generator=generator), ids, torch.rand(4, 2, generator=generator))
        self.wrong = 0
        self.errors: Counter[str] = Counter()

    def _greeted(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=WAIT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, Hello(self.fingerprint).to_frame(1))
        reply, _ = recv_frame(sock, time.monotonic() + WAIT_S)
        assert reply.opcode == Opcode.HELLO, reply.meta
        return sock

    def reference(self) -> torch.Tensor:
        send_frame(self.sock, self.request.to_frame(2))
        return Result.from_frame(recv_frame(self.sock, time.monotonic() + WAIT_S)[0]).outputs

    def measure(self, samples: int, reference: torch.Tensor) -> tuple[list[float], list[float], list[float]]:
        pings, dispatches, connects = [], [], []
        frame = self.request.to_frame(3)
        for i in range(samples):
            started = time.perf_counter()
            send_frame(self.sock, Frame(Opcode.PING, 4))
            recv_frame(self.sock, time.monotonic() + WAIT_S)
            pings.append(time.perf_counter() - started)
            started = time.perf_counter()
            send_frame(self.sock, frame)
            reply, _ = recv_frame(self.sock, time.monotonic() + WAIT_S)
            dispatches.append(time.perf_counter() - started)
            if reply.opcode == Opcode.ERROR:
                self.errors[ErrorReply.from_frame(reply).code] += 1
            elif reply.opcode != Opcode.RESULT or not torch.equal(Result.from_frame(reply).outputs, reference):
                self.wrong += 1
            if i % 10 == 0:
                started = time.perf_counter()
                self._greeted().close()
                connects.append(time.perf_counter() - started)
        return pings, dispatches, connects

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def _flood(address, fingerprint: str, connections: int, read: bool):
    """Connections that pipeline large DISPATCHes; `read`: they also read (and drop) the replies."""
    ids = torch.stack([torch.randperm(8)[:4] for _ in range(512)])  # [T, 4]
    frame = Dispatch(0, torch.randn(512, 32), ids, torch.rand(512, 4)).to_frame(9).to_bytes()
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(address, timeout=WAIT_S)
        send_frame(sock, Hello(fingerprint).to_frame(1))
        recv_frame(sock, time.monotonic() + WAIT_S)
        sock.settimeout(None)
        socks.append(sock)
    stop = threading.Event()

    def send(sock):
        with contextlib.suppress(OSError):
            while not stop.is_set():
                sock.sendall(frame)

    def drain(sock):
        with contextlib.suppress(OSError):
            while sock.recv(1 << 20):
                pass

    threads = [threading.Thread(target=send, args=(s,), daemon=True) for s in socks]
    if read:
        threads += [threading.Thread(target=drain, args=(s,), daemon=True) for s in socks]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(WAIT_S)


@contextlib.contextmanager
def _stalled(address, count: int, prefix: bytes):
    """`count` connections that send `prefix` (maybe nothing) and then stall."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.create_connection(address, timeout=WAIT_S)
            if prefix:
                sock.sendall(prefix)
            socks.append(sock)
        yield
    finally:
        for sock in socks:
            sock.close()


def _percentile(values: list[float], percent: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, int(percent) - 1))]


def run_flood_bench(half_open: int = 200, flooders: int = 4, samples: int = 300, *, handshakes: int | None = None,
                    amplification: bool = False, connections: int = 256, tokens: int = 8185, top_k: int = 8,
                    hold_s: float = 40.0) -> dict:
    """`moeswarm bench flood`: the floods (`run_flood`), or instead `handshakes` silent connections to a keyed
    worker (handshake_flood.py), or the reply-amplification attack (amplification.py)."""
    if handshakes is not None:
        from moeswarm_bench.bench.handshake_flood import run_handshake_flood

        return run_handshake_flood(handshakes)
    if amplification:
        from moeswarm_bench.bench.amplification import run_amplification

        return run_amplification(connections, tokens, top_k, hold_s)
    return run_flood(half_open, flooders, samples)
