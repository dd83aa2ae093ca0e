"""PING latency under load: does a worker answer PINGs while its experts compute a prefill?

One local worker holds every expert of the model. One link sends a large DISPATCH (a prefill:
every token routed to top-k experts of the first MoE layer the worker holds) again and again; a
second link sends one PING into each of those computes, and PINGs to the idle worker before. A
worker that computes on its event loop answers such a PING only after the DISPATCH (about a
whole prefill); one that computes off the loop answers it in microseconds.
"""

from __future__ import annotations

import statistics
import time

import torch

from moeswarm.dispatch.health import REPLY_TIMEOUT_S
from moeswarm.local.workers import local_workers
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.source import open_source
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.messages import Dispatch, WorkerInfo

WARMUP_DISPATCHES = 2
TIMED_DISPATCHES = 5


def run_ping_under_load(model: str, prefill_tokens: int = 2048, pings: int = 50) -> dict:
    """PING round trips (µs) on an idle worker and during prefill DISPATCHes, and one DISPATCH's time (ms)."""
    source = open_source(model)
    every_expert = list(range(num_experts_in_config(source.config)))
    with local_workers(model, [every_expert]) as (address,):
        load, probe = TcpLink(address), TcpLink(address)
        try:
            info = load.connect(source.fingerprint)
            probe.connect(source.fingerprint)
            request = _prefill(info, source.config, prefill_tokens)
            idle = [probe.ping(REPLY_TIMEOUT_S) for _ in range(pings)]
            for _ in range(WARMUP_DISPATCHES):
                _round_trip(load, request)
            prefill_s = statistics.median(_round_trip(load, request) for _ in range(TIMED_DISPATCHES))
            during = _pings_during(load, probe, request, pings, prefill_s)
        finally:
            load.close()
            probe.close()
    return {
        "model": str(model),
        "prefill_tokens": prefill_tokens,
        "pings": pings,
        "ping_idle_us_p50": statistics.median(idle) * 1e6,
        "ping_during_prefill_us_p50": statistics.median(during) * 1e6,
        "ping_during_prefill_us_max": max(during) * 1e6,
        "prefill_dispatch_ms": prefill_s * 1e3,
    }


def _pings_during(load: TcpLink, probe: TcpLink, request: Dispatch, pings: int, prefill_s: float) -> list[float]:
    """PING round trips on `probe`, one per DISPATCH on `load`, each sent well inside its compute.

    One PING per DISPATCH, at 10-80 % of the DISPATCH's usual time after sending it: back-to-back
    PINGs would mostly land in the gaps between DISPATCHes and hide a blocked worker.
    """
    rtts = []
    for i in range(pings):
        start = time.perf_counter()
        pending = load.send(load.prepare(request))
        offset = (0.1 + 0.7 * (i % 8) / 7) * prefill_s
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        rtts.append(probe.ping(REPLY_TIMEOUT_S))
        load.wait(pending, time.monotonic() + REPLY_TIMEOUT_S)
    return rtts


def _round_trip(link: TcpLink, request: Dispatch) -> float:
    start = time.perf_counter()
    link.wait(link.send(link.prepare(request)), time.monotonic() + REPLY_TIMEOUT_S)
    return time.perf_counter() - start


def _prefill(info: WorkerInfo, config, tokens: int) -> Dispatch:
    """A DISPATCH of `tokens` random hidden states, each routed to top-k distinct held experts."""
    layer = min(info.held)
    experts = torch.tensor(info.held[layer])
    top_k = min(int(getattr(config, "num_experts_per_tok", 8)), len(experts))
    generator = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, len(experts), generator=generator).argsort(dim=1)[:, :top_k]  # [T, k]
    dtype = _dtype(config)
    hidden = torch.randn(tokens, info.hidden_size, generator=generator).to(dtype)  # [T, d]
    weights = torch.rand(tokens, top_k, generator=generator).to(dtype)  # [T, k]
    return Dispatch(layer, hidden, experts[choice], weights)


def _dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype
