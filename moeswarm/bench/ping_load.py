"""PING latency under load: does a worker answer PINGs while its experts compute a prefill?

One local worker holds every expert of the model. One connection sends a large DISPATCH (a
prefill: every token routed to top-k experts of the first MoE layer it holds) again and again;
a second connection sends one PING into each of those computes, and PINGs to the idle worker
before. A worker that computes on its event loop answers such a PING only after the DISPATCH
(about a whole prefill); one that computes off the loop answers it in microseconds.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time

import torch

from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, WorkerInfo
from moeswarm.wire.stream import recv_frame, send_frame

START_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 120.0
WARMUP_DISPATCHES = 2
TIMED_DISPATCHES = 5


def run_ping_under_load(model: str, prefill_tokens: int = 2048, pings: int = 50) -> dict:
    """PING round trips (µs) on an idle worker and during prefill DISPATCHes, and one DISPATCH's time (ms)."""
    fingerprint, config = _model_facts(model)
    process, address = _start_worker(model, config)
    try:
        (load, info), (probe, _) = _greeted(address, fingerprint), _greeted(address, fingerprint)
        request = _prefill(info, config, prefill_tokens)
        idle = [_ping(probe) for _ in range(pings)]
        for _ in range(WARMUP_DISPATCHES):
            _round_trip(load, request)
        prefill_s = statistics.median(_round_trip(load, request) for _ in range(TIMED_DISPATCHES))
        during = _pings_during(load, probe, request, pings, prefill_s)
        load.close()
        probe.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    return {
        "model": str(model),
        "prefill_tokens": prefill_tokens,
        "pings": pings,
        "ping_idle_us_p50": statistics.median(idle) * 1e6,
        "ping_during_prefill_us_p50": statistics.median(during) * 1e6,
        "ping_during_prefill_us_max": max(during) * 1e6,
        "prefill_dispatch_ms": prefill_s * 1e3,
    }


def _pings_during(load: socket.socket, probe: socket.socket, request: Frame, pings: int, prefill_s: float) -> list[float]:
    """PING round trips on `probe`, one per DISPATCH on `load`, each sent well inside its compute.

    One PING per DISPATCH, at 10-80 % of the DISPATCH's usual time after sending it: back-to-back
    PINGs would mostly land in the gaps between DISPATCHes and hide a blocked worker.
    """
    rtts = []
    for i in range(pings):
        start = time.perf_counter()
        send_frame(load, request)
        offset = (0.1 + 0.7 * (i % 8) / 7) * prefill_s
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        rtts.append(_ping(probe))
        _expect(load, request.request_id, Opcode.RESULT)
    return rtts


def _round_trip(sock: socket.socket, request: Frame) -> float:
    start = time.perf_counter()
    send_frame(sock, request)
    _expect(sock, request.request_id, Opcode.RESULT)
    return time.perf_counter() - start


def _ping(sock: socket.socket) -> float:
    start = time.perf_counter()
    send_frame(sock, Frame(Opcode.PING, 1))
    _expect(sock, 1, Opcode.PONG)
    return time.perf_counter() - start


def _expect(sock: socket.socket, request_id: int, opcode: Opcode) -> Frame:
    reply, _ = recv_frame(sock, time.monotonic() + REPLY_TIMEOUT_S)
    if reply.opcode == Opcode.ERROR:
        raise MoeSwarmError(f"worker refused the benchmark's request: {ErrorReply.from_frame(reply).message}")
    if (reply.opcode, reply.request_id) != (opcode, request_id):
        raise MoeSwarmError(f"expected {opcode.name} {request_id}, got {reply.opcode.name} {reply.request_id}")
    return reply


def _prefill(info: WorkerInfo, config, tokens: int) -> Frame:
    """A DISPATCH of `tokens` random hidden states, each routed to top-k distinct held experts."""
    layer = min(info.held)
    experts = torch.tensor(info.held[layer])
    top_k = min(int(getattr(config, "num_experts_per_tok", 8)), len(experts))
    generator = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, len(experts), generator=generator).argsort(dim=1)[:, :top_k]  # [T, k]
    dtype = _dtype(config)
    hidden = torch.randn(tokens, info.hidden_size, generator=generator).to(dtype)  # [T, d]
    weights = torch.rand(tokens, top_k, generator=generator).to(dtype)  # [T, k]
    return Dispatch(layer, hidden, experts[choice], weights).to_frame(2)


def _dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _model_facts(model: str):
    """(fingerprint, transformers config) of the model at `model`."""
    try:
        from moeswarm.model.source import open_source
    except ImportError:  # older trees: a model directory only
        from moeswarm.model.checkpoint import Checkpoint as source_type

        source = source_type.open(model)
    else:
        source = open_source(model)
    return source.fingerprint, source.config


def _start_worker(model: str, config) -> tuple[subprocess.Popen, tuple[str, int]]:
    """A `moeswarm worker` holding every expert: (process, (host, port))."""
    base = [sys.executable, "-m", "moeswarm.cli", "worker", "--model", str(model), "--port", "0", "--threads", "1"]
    process, address = _spawn(base)
    if address is None:  # a CLI where --experts is still required
        from moeswarm.model.experts import num_experts_in_config

        process, address = _spawn(base + ["--experts", f"0-{num_experts_in_config(config) - 1}"])
        if address is None:
            raise MoeSwarmError(f"worker exited before listening: {process.stderr.read().strip()[-2000:]}")
    return process, address


def _spawn(command: list[str]) -> tuple[subprocess.Popen, tuple[str, int] | None]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            process.wait()
            return process, None
        if "listening on " in line:
            host, port = line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)
            return process, (host, int(port))
    process.kill()
    raise MoeSwarmError(f"worker did not start within {START_TIMEOUT_S:.0f} s")


def _greeted(address: tuple[str, int], fingerprint: str) -> tuple[socket.socket, WorkerInfo]:
    """A connection after HELLO, and what the worker said it holds."""
    try:
        sock = socket.create_connection(address, timeout=REPLY_TIMEOUT_S)
    except OSError as error:
        raise WorkerError(f"{address[0]}:{address[1]}", f"cannot connect ({error})") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(sock, Hello(fingerprint).to_frame(1))
    return sock, WorkerInfo.from_frame(_expect(sock, 1, Opcode.HELLO))
