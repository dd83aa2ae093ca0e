"""`moeswarm bench flood --amplification`: the reply-amplification attack on a worker, with its RSS.

One `moeswarm worker` process holds every expert of a model (default: the bundled one, d 128,
32 experts, top-8). `connections` clients each send HELLO, then one big DISPATCH within the
worker's limits whose every id is the same held expert (`top_k` slots per token: the largest
RESULT that DISPATCH can ask for), and never read a byte. Meanwhile a well-behaved client times
PINGs and checks a small DISPATCH; the worker's RSS is sampled. After `hold_s` the attackers
close, and RSS is read again once the worker settled.

Reported: the worker's RSS (MB) before, at its peak and after; the well-behaved client's
outcomes; how many attack requests the worker read. Run it with the issue's figures
(`--top-k 64`: refused by a worker that caps top-k at its model's) and with the model's own
top-k (`--top-k 8`), the strongest such request the worker admits.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter

import psutil
import torch

from moeswarm_bench.bench.worker_process import spawn_worker
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result
from moeswarm.wire.stream import recv_frame, send_frame

WAIT_S = 30.0


def run_amplification(connections: int = 256, tokens: int = 8185, top_k: int = 8, hold_s: float = 40.0,
                      model: str | None = None, worker_args: tuple[str, ...] = ()) -> dict:
    from moeswarm.bundled import demo_model
    from moeswarm.model.experts import num_experts_in_config
    from moeswarm.sources.source import open_source

    model = str(model or demo_model())
    source = open_source(model)
    hidden, experts = source.config.hidden_size, num_experts_in_config(source.config)
    ids = torch.zeros(tokens, top_k, dtype=torch.long)  # every slot: expert 0, held
    attack = Dispatch(0, torch.randn(tokens, hidden), ids, torch.rand(tokens, top_k)).to_frame(7).to_bytes()
    args = ("--max-connections", str(connections + 16), "--max-connections-per-peer", str(connections + 16),
            *worker_args)
    with spawn_worker(model, range(experts), args) as (address, process):
        worker = psutil.Process(process.pid)
        good = _GoodClient(address, source.fingerprint, hidden)
        time.sleep(1.0)
        before = worker.memory_info().rss
        sampler = _Sampler(worker)
        attackers = _attack(address, source.fingerprint, attack, connections)
        outcomes: Counter[str] = Counter()
        ping_ms = []
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            outcome, rtt = good.round()
            outcomes[outcome] += 1
            ping_ms.append(rtt * 1e3)
            time.sleep(0.25)
        held_open = _established(worker) - 1  # the worker's connections but the good client's
        for sock in attackers:
            with contextlib.suppress(OSError):
                sock.close()
        time.sleep(3.0)
        after = worker.memory_info().rss
        sampler.stop()
        good.close()
    ping_ms.sort()
    return {
        "connections": connections, "tokens": tokens, "top_k": top_k, "hidden": hidden,
        "dispatch_mb": round(len(attack) / 2**20, 1),
        "reply_asked_mb": round(tokens * top_k * hidden * 4 / 2**20, 1),
        "hold_s": hold_s,
        "rss_before_mb": round(before / 2**20, 1), "rss_peak_mb": round(sampler.peak / 2**20, 1),
        "rss_after_mb": round(after / 2**20, 1),
        "attack_connections_open_at_end": held_open,
        "good_client": dict(outcomes),
        "good_ping_ms_p50": round(ping_ms[len(ping_ms) // 2], 2) if ping_ms else None,
        "good_ping_ms_max": round(ping_ms[-1], 2) if ping_ms else None,
    }


class _GoodClient:
    """A backbone-like client: PING and a small DISPATCH per round, every RESULT checked."""

    def __init__(self, address, fingerprint: str, hidden: int):
        self.sock = socket.create_connection(address, timeout=WAIT_S)
        send_frame(self.sock, Hello(fingerprint).to_frame(1))
        assert recv_frame(self.sock, time.monotonic() + WAIT_S)[0].opcode == Opcode.HELLO
        generator = torch.Generator().manual_seed(0)
        self.request = Dispatch(0, torch.randn(4, hidden, generator=generator), torch.tensor([[0, 5]] * 4),
                                torch.rand(4, 2, generator=generator))
        self.reference = None
        self.rid = 10

    def round(self) -> tuple[str, float]:
        self.rid += 2
        try:
            started = time.perf_counter()
            send_frame(self.sock, Frame(Opcode.PING, self.rid))
            recv_frame(self.sock, time.monotonic() + WAIT_S)
            rtt = time.perf_counter() - started
            send_frame(self.sock, self.request.to_frame(self.rid + 1))
            reply, _ = recv_frame(self.sock, time.monotonic() + WAIT_S)
        except (OSError, EOFError) as error:
            return f"failed: {type(error).__name__}", float("nan")
        if reply.opcode == Opcode.ERROR:
            return f"error {ErrorReply.from_frame(reply).code}", rtt
        outputs = Result.from_frame(reply).outputs
        if self.reference is None:
            self.reference = outputs
        return ("result" if torch.equal(outputs, self.reference) else "wrong result"), rtt

    def close(self) -> None:
        self.sock.close()


def _attack(address, fingerprint: str, frame: bytes, connections: int) -> list[socket.socket]:
    """`connections` greeted sockets that each send `frame` once (from a few threads) and never read."""
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(address, timeout=WAIT_S)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # take as little of the replies as we can
        send_frame(sock, Hello(fingerprint).to_frame(1))
        recv_frame(sock, time.monotonic() + WAIT_S)
        socks.append(sock)

    def send(share: list[socket.socket]) -> None:
        for sock in share:
            with contextlib.suppress(OSError):
                sock.settimeout(WAIT_S)
                sock.sendall(frame)

    threads = [threading.Thread(target=send, args=(socks[i::16],), daemon=True) for i in range(16)]
    for thread in threads:
        thread.start()
    return socks


def _established(process: psutil.Process) -> int:
    """TCP connections the process holds open (established)."""
    listing = getattr(process, "net_connections", None) or process.connections
    return sum(1 for c in listing(kind="tcp") if c.status == psutil.CONN_ESTABLISHED)


class _Sampler:
    """The process's peak RSS, sampled every 50 ms on a thread."""

    def __init__(self, process: psutil.Process):
        self.process, self.peak = process, process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
