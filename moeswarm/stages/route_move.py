"""`better_route`: whether a running gateway moves its chain to another route (a pure function).

The route in use was the best when it was chosen; stages announced since may make another one
cheaper (stages/route.py: a route costs the round trips to the stages it uses plus `CROSSING_MS`
per stage), and a link may slow down or speed up (the gateway measures each round trip again once
it is `remeasure_s` old, stages/remeasure.py). Moving costs a replay of the step log on the new
stages, and each measured round trip carries noise, so the chain moves only for a clear gain: the
best route now must cost less than the route in use by at least `MOVE_FRACTION` of the route in
use's cost and at least `MOVE_MS`.
A stage of the route in use that is not among the offers (its record gone, or not answering the
probe) counts a round trip of 0: unknown is never a reason to move.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeswarm.stages.route import Offer, Position, RouteError, plan_route, route_cost

MOVE_FRACTION = 0.2  # the least gain worth a move, as a fraction of the route in use's cost
MOVE_MS = 5.0  # and in ms: below this a gain is within what one probe's noise can make


def in_use_cost(offers: Sequence[Offer], in_use: Sequence[tuple[range, str]]) -> float:
    """The cost of the route in use: per position in layer order, (its span, the address used)."""
    return route_cost(_rtt(offers, layers, address) for layers, address in in_use)


def better_route(offers: Sequence[Offer], num_layers: int,
                 in_use: Sequence[tuple[range, str]]) -> list[Position] | None:
    """The route to move to from `in_use` (per position in layer order: its span, the address used),
    by the margin above; None to stay (no tiling, the best is the route in use, or too small a gain)."""
    try:
        best = plan_route(offers, num_layers)
    except RouteError:
        return None
    if [(p.layers, p.replicas[0]) for p in best] == [(layers, address) for layers, address in in_use]:
        return None
    now = in_use_cost(offers, in_use)
    then = route_cost(_rtt(offers, p.layers, p.replicas[0]) for p in best)
    return best if now - then >= max(MOVE_MS, MOVE_FRACTION * now) else None


def _rtt(offers: Sequence[Offer], layers: range, address: str) -> float:
    """The least round trip measured to `address` serving `layers`; 0 when it is not offered."""
    return min((o.rtt_ms for o in offers if o.address == address and o.layers == layers), default=0.0)
