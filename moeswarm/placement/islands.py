"""Islands from measured RTTs, and the expected per-token time of three layouts (pure).

Given machines (their room, as a share of the model, and their compute time per layer of a decode
token), the RTT between every two of them and the gateway's machine:

- **islands**: machines closer than `island_rtt_ms` to each other form an island (connected
  components); each island takes a contiguous span of layers in proportion to its room; the chain
  visits islands nearest-first from the gateway. A token crosses one link per hop
  (gateway -> island 1 -> ... -> gateway) and, inside an island, one LAN round trip per layer
  between its stage (the member nearest the others) and its workers.
- **star**: the gateway holds every trunk, the experts are spread over every machine: each layer
  costs a round trip to the farthest machine.
- **layer split**: every machine holds whole layers (a span in proportion to its room), visited
  nearest-first: one link per hop, no expert trips.

Every estimate adds the layers' compute (each layer at the speed of the machine holding it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    name: str
    room: float  # the share of the model's weights it can hold (sums to >= 1 over the machines)
    ms_per_layer: float  # one decode token through one whole layer on this machine


@dataclass(frozen=True)
class Island:
    members: tuple[str, ...]
    stage: str  # the member the others (its workers) are nearest to
    layers: range


@dataclass(frozen=True)
class Estimate:
    islands: list[Island]
    islands_ms: float
    star_ms: float
    layer_split_ms: float
    layer_split_order: list[str]


def rtt(rtts: dict[frozenset, float], a: str, b: str) -> float:
    return 0.0 if a == b else rtts[frozenset((a, b))]


def plan_islands(machines: list[Machine], rtts: dict[frozenset, float], gateway: str, layers: int,
                 island_rtt_ms: float = 5.0) -> Estimate:
    """The islands and the per-token estimates of islands, star and layer split (ms)."""
    by_name = {m.name: m for m in machines}
    groups = _components([m.name for m in machines], rtts, island_rtt_ms)
    order = _nearest_first(groups, rtts, gateway)
    spans = _spans([sum(by_name[n].room for n in group) for group in order], layers)
    islands = [Island(tuple(group), min(group, key=lambda s: sum(rtt(rtts, s, o) for o in group)), span)
               for group, span in zip(order, spans) if len(span)]
    hops = [gateway] + [island.stage for island in islands] + [gateway]
    wire = sum(rtt(rtts, a, b) / 2 for a, b in zip(hops, hops[1:]))
    inside = sum(len(island.layers) * (max(rtt(rtts, island.stage, m) for m in island.members)
                                       + max(by_name[m].ms_per_layer for m in island.members))
                 for island in islands)
    star = layers * (max(rtt(rtts, gateway, m.name) for m in machines) + max(m.ms_per_layer for m in machines))
    chain = [names[0] for names in _nearest_first([[m.name] for m in machines], rtts, gateway)]
    split_spans = _spans([by_name[n].room for n in chain], layers)
    split_hops = [gateway] + [n for n, span in zip(chain, split_spans) if len(span)] + [gateway]
    split = sum(rtt(rtts, a, b) / 2 for a, b in zip(split_hops, split_hops[1:])) + \
        sum(len(span) * by_name[n].ms_per_layer for n, span in zip(chain, split_spans))
    return Estimate(islands, wire + inside, star, split, [n for n, s in zip(chain, split_spans) if len(s)])


def _components(names: list[str], rtts: dict[frozenset, float], limit: float) -> list[list[str]]:
    groups: list[list[str]] = []
    for name in names:
        near = [g for g in groups if any(rtt(rtts, name, other) <= limit for other in g)]
        merged = [name] + [n for g in near for n in g]
        groups = [g for g in groups if g not in near] + [sorted(merged)]
    return groups


def _nearest_first(groups: list[list[str]], rtts: dict[frozenset, float], start: str) -> list[list[str]]:
    """The groups in chain order: each next one the nearest to the last visited."""
    left, order, at = [list(g) for g in groups], [], start
    while left:
        nearest = min(left, key=lambda g: (min(rtt(rtts, at, n) for n in g), g))
        order.append(nearest)
        left.remove(nearest)
        at = min(nearest, key=lambda n: rtt(rtts, at, n))
    return order


def _spans(rooms: list[float], layers: int) -> list[range]:
    """Contiguous spans of `layers` in proportion to `rooms` (largest remainders)."""
    total = sum(rooms)
    if total <= 0:
        raise ValueError("the machines have no room for the model")
    exact = [layers * r / total for r in rooms]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(rooms)), key=lambda i: exact[i] - counts[i], reverse=True)[: layers - sum(counts)]:
        counts[i] += 1
    spans, at = [], 0
    for count in counts:
        spans.append(range(at, at + count))
        at += count
    return spans
