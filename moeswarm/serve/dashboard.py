"""The dashboard's data (GET /v1/dashboard): workers, coverage with replicas, expert heat, throughput.

The page (dashboard.html, GET /) polls it every second or two; nothing here blocks the engine.
"""

from __future__ import annotations

from pathlib import Path

from moeswarm.ids import format_ids

PAGE = Path(__file__).with_name("dashboard.html")


def dashboard_data(state) -> dict:
    engine = state.engine
    if engine is None:
        return {"model": state.model_id, "status": "loading", "problems": [state.loading], "workers": []}
    swarm, stats = engine.swarm, engine.stats
    layers = list(swarm.moe_layers)
    standing = {s["worker"]: s for s in swarm.standing()}
    rtt = stats.workers()
    workers, replicas = [], [[0] * stats.num_experts for _ in layers]
    for address, held in swarm.holdings():
        state_of = standing.get(address, {})
        up = state_of.get("up", True) and not state_of.get("banned", False)
        experts = sorted({e for ids in held.values() for e in ids})
        workers.append({
            "address": address, "path": "local" if address == "local" else "direct",
            "state": "banned" if state_of.get("banned") else ("up" if up else "down"),
            "cause": state_of.get("cause"), "layers": format_ids(sorted(held)), "experts": format_ids(experts),
            "calls": rtt.get(address, {}).get("calls", 0),
            "rtt_ms_p50": rtt.get(address, {}).get("rtt_ms_p50"), "rtt_ms_p99": rtt.get(address, {}).get("rtt_ms_p99"),
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
        "heat": stats.heat(layers),
        "routing": swarm.routing_stats().summary(),  # live counts per (layer, expert) and most frequent pairs
        "recent": stats.recent(),
        "totals": dict(stats.totals),
        "active": engine.active,
        "queued": engine.queue_depth,
    }
