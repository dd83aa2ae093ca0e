"""The dashboard's data (GET /v1/dashboard): workers, coverage with replicas, expert heat, throughput,
and the last minutes of it as time series.

The page (dashboard.html, GET /) polls it every second or two; nothing here blocks the engine.
`History` samples tokens/s, batch size and the workers' round-trip time every SAMPLE_S seconds
(a task of the app's), so a page opened now still shows the last HISTORY_S seconds.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path

from moeswarm.discovery.member_about import member_about
from moeswarm.discovery.swarm_view import path_of
from moeswarm.ids import format_ids

PAGE = Path(__file__).with_name("dashboard.html")
SAMPLE_S = 2.0
HISTORY_S = 300.0


class History:
    def __init__(self):
        self.samples: deque[dict] = deque(maxlen=int(HISTORY_S / SAMPLE_S))

    def sample(self, state) -> None:
        engine = state.engine
        if engine is None:
            return
        recent = engine.stats.recent()
        rtts = [w["rtt_ms_p50"] for w in engine.stats.workers().values() if w["calls"]]
        self.samples.append({"at": time.time(), "tokens_per_s": recent["tokens_per_s"],
                             "batch_size": recent["batch_size"] if recent["steps_per_s"] else 0.0,
                             "rtt_ms": statistics.median(rtts) if rtts else None})

    def series(self) -> list[dict]:
        return list(self.samples)


def dashboard_data(state) -> dict:
    engine = state.engine
    if engine is None:
        return {"model": state.model_id, "status": "loading", "problems": [state.loading], "workers": []}
    swarm, stats = engine.swarm, engine.stats
    layers = list(swarm.moe_layers)
    standing = {s["worker"]: s for s in swarm.standing()}
    announced, now = swarm.announced(), time.time()
    rtt = stats.workers()
    workers, replicas = [], [[0] * stats.num_experts for _ in layers]
    for address, held in swarm.holdings():
        state_of = standing.get(address, {})
        up = state_of.get("up", True) and not state_of.get("banned", False)
        experts = sorted({e for ids in held.values() for e in ids})
        record = announced.get(address)
        workers.append({
            "address": address, "path": "local" if address == "local" else path_of(address),
            "state": "banned" if state_of.get("banned") else ("down" if not up else
                                                              "degraded" if state_of.get("degraded") else "up"),
            "cause": state_of.get("cause"), "layers": format_ids(sorted(held)), "experts": format_ids(experts),
            "calls": rtt.get(address, {}).get("calls", 0),
            "rtt_ms_p50": rtt.get(address, {}).get("rtt_ms_p50"), "rtt_ms_p99": rtt.get(address, {}).get("rtt_ms_p99"),
            **member_about(record, now),
        })
        if up:
            for row, layer in enumerate(layers):
                for expert in held.get(layer, ()):
                    replicas[row][expert] += 1
    return {
        "model": state.model_id,
        "status": "unavailable" if engine.problems else "ok",
        "problems": engine.problems,
        "workers": workers,
        "layers": layers,
        "num_experts": stats.num_experts,
        "replicas": replicas,
        "heat": stats.heat(layers, swarm.routing_stats().counts),
        "routing": swarm.routing_stats().summary(),  # live counts per (layer, expert) and most frequent pairs
        "recent": stats.recent(),
        "totals": dict(stats.totals),
        "speculation": engine.speculation.summary(),  # drafts verified, accepted per position (engine/speculation.py)
        "active": engine.active,
        "queued": engine.queue_depth,
        "history": state.history.series(),  # oldest first, one every SAMPLE_S seconds
        "sample_s": SAMPLE_S,
    }
