"""The `/swarm` page's data (`GET /v1/swarm`): the gateway's members and the coverage per MoE layer.

Built from what the dashboard reads (serve/dashboard.py: the members this gateway uses, their
state and round trips, what their DHT records say of them (version, uptime, tokens/s measured at
start, rows per minute lately: discovery/member_about.py), and the holders of each expert among
the members that are up), with each
layer's least-held experts and the weakest layers marked (discovery/swarm_view.py's rows). A
gateway over stages adds its stages, the coverage per span and the route in use (serve/chain_page.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from moeswarm.discovery.swarm_view import layer_rows
from moeswarm.serve.chain_page import chain_data
from moeswarm.serve.dashboard import dashboard_data
from moeswarm.stages.gateway import chain_of

PAGE = Path(__file__).with_name("swarm.html")


def swarm_data(state) -> dict:
    data = dashboard_data(state)
    members = [{key: worker.get(key) for key in ("address", "path", "state", "cause", "layers", "experts", "calls",
                                                  "rtt_ms_p50", "version", "uptime_s", "tokens_per_s", "load")}
               for worker in data["workers"]]
    if "layers" not in data:  # still loading
        return {"model": data["model"], "status": data["status"], "members": members, "layers": []}
    rows = layer_rows(dict(zip(data["layers"], data["replicas"])))
    chain = chain_of(state.engine.swarm.model)
    return {"model": data["model"], "status": data["status"], "members": members,
            "layers": [{"layer": r.layer, "fewest": r.fewest, "weakest": list(r.weakest), "weakest_layer": r.weakest_layer}
                       for r in rows],
            "tokens_generated": data["totals"].get("generated", 0),
            "tokens_per_s": data["recent"].get("tokens_per_s"),
            **({"chain": chain_data(chain, time.time())} if chain is not None else {})}
