"""`plan_route`: the stages announced on the swarm -> the gateway's chain (a pure function).

Each offer is one stage: its address, the span of decoder layers it holds, and the round trip the
gateway measured to it. A route is a list of positions covering layers 0..L-1 in order; each
position is one span and its replicas (every offer of exactly that span), the first the one used
and the others taken over in turn when it fails (stages/client.py). A route's cost is the sum over
its positions of the round trip to the replica used plus `CROSSING_MS` (a step crosses the network
stages + 1 times, and every stage adds its own fixed work: one more stage is not free on loopback
either). Among the tilings of 0..L-1 by announced spans, the route is, in this order of rules:

1. the lowest cost (each position counted at its fastest replica);
2. then the fewest stages;
3. then the most replicas at its least replicated position (the most failovers before a span is lost);
4. then the earliest cuts (the sequence of span ends, compared in order): a fixed choice.

Replicas are ordered fastest first (then by address). Spans that cannot be part of a tiling
(beyond the model, or overlapping the chosen ones) are simply not used. No tiling at all is a
RouteError naming the first gap: layers no stage holds, or the layer after which no announced
span starts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from moeswarm.errors import MoeSwarmError

SPANS_NAMED = 12  # spans listed in an error, then "..."
CROSSING_MS = 10.0  # what a route counts for each stage besides its round trip: a chosen weight, not a measurement


class RouteError(MoeSwarmError):
    """The announced stages do not tile the model's layers (one line naming the gap)."""


@dataclass(frozen=True)
class Offer:
    """One announced stage: where it is, which decoder layers it holds, its measured round trip;
    and what its record says of it (version, started: discovery/stage_record.py), shown on the
    `/swarm` page, never used to route."""

    address: str
    layers: range
    rtt_ms: float = 0.0
    version: str | None = None
    started: float | None = None


@dataclass(frozen=True)
class Position:
    """One position of a route: a span of decoder layers and the stages holding exactly it, fastest first."""

    layers: range
    replicas: tuple[str, ...]


Span = tuple[int, int]  # (start, stop): layers [start, stop)


def plan_route(offers: Sequence[Offer], num_layers: int) -> list[Position]:
    """The route's positions in layer order, by the rules above; RouteError when the offers do not
    tile layers 0..num_layers-1."""
    replicas = _replicas(offers, num_layers)
    best: tuple | None = None
    for floor in sorted({len(r) for r in replicas.values()}, reverse=True):
        # the best tiling using only spans with at least `floor` replicas: taken over every floor, the
        # best by (cost, stages, -least replicas, cuts) is the best over all tilings (rule 3 is a minimum)
        tiling = _best_tiling({span: r for span, r in replicas.items() if len(r) >= floor}, num_layers)
        if tiling is not None:
            cost, stages, cuts, spans = tiling
            key = (cost, stages, -min(len(replicas[s]) for s in spans), cuts)
            if best is None or key < best[0]:
                best = (key, spans)
    if best is None:
        raise RouteError(_gap(sorted(replicas), num_layers))
    return [Position(range(*span), tuple(offer.address for offer in replicas[span])) for span in best[1]]


def _replicas(offers: Sequence[Offer], num_layers: int) -> dict[Span, list[Offer]]:
    """{span within the model: its offers, fastest first, one per address}."""
    by_span: dict[Span, dict[str, Offer]] = defaultdict(dict)
    for offer in offers:
        span = (offer.layers.start, offer.layers.stop)
        if 0 <= span[0] < span[1] <= num_layers:
            kept = by_span[span].get(offer.address)
            if kept is None or offer.rtt_ms < kept.rtt_ms:
                by_span[span][offer.address] = offer
    return {span: sorted(found.values(), key=lambda o: (o.rtt_ms, o.address)) for span, found in by_span.items()}


def route_cost(rtts_ms) -> float:
    """The cost of a route whose stages in use have these round trips (ms), in layer order."""
    return sum(rtt + CROSSING_MS for rtt in rtts_ms)


def _best_tiling(replicas: dict[Span, list[Offer]], num_layers: int) -> tuple | None:
    """(cost, stages, cuts, spans) of the tiling of [0, num_layers) least by (cost, stages, cuts),
    or None. Dynamic programming from the last layer back: for a fixed first span, the order of
    whole tilings is the order of their rests."""
    starting: dict[int, list[Span]] = defaultdict(list)
    for span in replicas:
        starting[span[0]].append(span)
    best: dict[int, tuple] = {num_layers: (0.0, 0, (), ())}  # boundary -> best tiling of [boundary, num_layers)
    for start in range(num_layers - 1, -1, -1):
        for span in starting.get(start, ()):
            rest = best.get(span[1])
            if rest is None:
                continue
            candidate = (route_cost([replicas[span][0].rtt_ms]) + rest[0], rest[1] + 1, (span[1],) + rest[2],
                         (span,) + rest[3])
            if start not in best or candidate[:3] < best[start][:3]:
                best[start] = candidate
    return best.get(0)


def _gap(spans: list[Span], num_layers: int) -> str:
    """The first gap of `spans` (sorted, within the model) in layers 0..num_layers-1, in words."""
    listed = ", ".join(_name(s) for s in spans[:SPANS_NAMED]) + (", ..." if len(spans) > SPANS_NAMED else "")
    announced = f"(announced: {listed})" if spans else "(none announced)"
    covered = [False] * num_layers
    for start, stop in spans:
        covered[start:stop] = [True] * (stop - start)
    if not all(covered):
        first = covered.index(False)
        last = covered.index(True, first) - 1 if True in covered[first:] else num_layers - 1
        return f"no stage holds decoder layers {_name((first, last + 1))} of 0-{num_layers - 1} {announced}"
    reached, frontier = {0}, [0]  # boundaries a chain of spans from layer 0 ends at
    while frontier:
        at = frontier.pop()
        for start, stop in spans:
            if start == at and stop not in reached:
                reached.add(stop)
                frontier.append(stop)
    after = max(reached)
    return (f"the stages overlap without tiling decoder layers 0-{num_layers - 1}: after layers 0-{after - 1} "
            f"none starts at layer {after} {announced}")


def _name(span: Span) -> str:
    return f"{span[0]}-{span[1] - 1}"
