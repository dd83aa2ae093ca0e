"""The stages part of the `/swarm` page's data, for a gateway over a chain of stages: every stage
the swarm offers (its round trip from here, whether the route in use has it, the version and
uptime its record says: discovery/member_about.py), the coverage per span with the weakest
marked, and the route in use with its cost (stages/route_move.py)."""

from __future__ import annotations

from moeswarm.discovery.stage_view import span_rows, stage_json, stage_rows
from moeswarm.stages.client import Chain
from moeswarm.stages.route_move import in_use_cost


def chain_data(chain: Chain, now: float) -> dict:
    """{"stages", "spans", "route", "route_cost_ms", "reroutes", "failovers"} of the chain now
    (`now`: Unix seconds here, for the uptimes of the stages offered: their records' `started`)."""
    route = list(zip(chain.spans or (), chain.route))
    offers = list(chain.offered()) if chain.offered is not None else []
    seen = {(o.address, o.layers.start, o.layers.stop) for o in offers}
    stages = [(o.address, o.layers, o.rtt_ms, "", o) for o in offers]
    for span, replicas in zip(chain.spans or (), list(chain.positions)):  # the chain's own, offered or not
        stages += [(a, span, None, "", None) for a in list(replicas) if (a, span.start, span.stop) not in seen]
    rows = stage_rows(stages, route, now)
    return {**stage_json(rows, span_rows([(address, layers) for address, layers, *_ in stages]), route),
            "route_cost_ms": in_use_cost(offers, route) if offers else None,
            "reroutes": chain.reroutes, "failovers": chain.failovers}
