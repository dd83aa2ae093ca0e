"""A joining member's share: which experts to hold, where the swarm is weakest (`moeswarm join`).

Pure functions over plain data; the command reads the coverage from the DHT, calls `choose_share`,
then acts on the result (fetch, announce, serve).

    L = the model's MoE layers, E = experts per layer
    holders[l][e]  members that announce expert e of layer l     (coverage_of)
    load[l][e]     its measured share of the routing (1 where unknown)

A share is a set of experts held at every MoE layer (a slice file holds that: slices/fetch.py).
Adding a member that holds expert e gives one more holder to each cell (l, e), so experts add
independently, and expert e is worth

    gain(e) = (cells of e that nobody holds,  cells of e that one member holds,
               sum over held cells of load[l][e] / (h (h + 1)))

where h = holders[l][e]: first cover what is uncovered, then give a second holder to what one
member alone holds (so that losing any one member uncovers nothing), then cut the load per holder
(load / h -> load / (h + 1)) where it is highest. Redundancy comes before load: with loads
first, a third holder of a hot expert outranks a second holder of a cold one, and a member that
leaves then takes the cold expert's only copy with it. A share's worth is the sum of its experts'
gains, compared in that order; the best share of `count` experts is the
`count` experts of highest gain (sums of independent terms: no other subset does better), ties
taken in `order` (a joiner's own permutation, so joiners reading the same coverage at once do
not all pick the same experts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from moeswarm.errors import MoeSwarmError

Coverage = Mapping[int, Sequence[int]]  # {MoE layer: holders of each expert, by expert id}
Gain = tuple[int, int, Fraction]  # (cells newly covered, cells given a second holder, load per holder removed)


@dataclass(frozen=True)
class Share:
    """A joiner's chosen experts (ascending) and what they add to the swarm."""

    experts: tuple[int, ...]
    covers: int  # (layer, expert) cells nobody held before
    backs: int  # cells one member alone held before
    relief: Fraction  # load per holder removed, summed over the cells already held


def coverage_of(helds: Iterable[Mapping[int, Sequence[int]]], layers: Sequence[int],
                num_experts: int) -> dict[int, list[int]]:
    """{layer: holders per expert} of the model's MoE `layers`, from each member's {layer: experts}
    (layers outside `layers` and experts out of range are not counted)."""
    coverage = {layer: [0] * num_experts for layer in layers}
    for held in helds:
        for layer, experts in held.items():
            if layer in coverage:
                for expert in set(experts):
                    if 0 <= expert < num_experts:
                        coverage[layer][expert] += 1
    return coverage


def gain(coverage: Coverage, expert: int, load: Coverage | None = None) -> Gain:
    """What holding `expert` at every layer adds: (cells newly covered, cells given a second holder,
    load per holder removed)."""
    covers, backs, relief = 0, 0, Fraction(0)
    for layer, holders in coverage.items():
        h = holders[expert]
        if h == 0:
            covers += 1
        else:
            backs += h == 1
            weight = 1 if load is None else load[layer][expert]
            relief += Fraction(weight, h * (h + 1))
    return covers, backs, relief


def choose_share(coverage: Coverage, count: int, load: Coverage | None = None,
                 order: Sequence[int] | None = None) -> Share:
    """The best share of `count` experts (see the module's docstring).

    coverage: holders per expert of every MoE layer (each list E long). load: the same shape,
    non-negative integers (None: 1 everywhere). order: a permutation of 0..E-1 taking ties
    (None: ascending ids). count: 1 to E."""
    num_experts = _width(coverage)
    if not 1 <= count <= num_experts:
        raise MoeSwarmError(f"a share takes 1 to {num_experts} experts, not {count}")
    order = list(range(num_experts)) if order is None else list(order)
    if sorted(order) != list(range(num_experts)):
        raise ValueError(f"order is not a permutation of 0-{num_experts - 1}")
    rank = {expert: i for i, expert in enumerate(order)}
    gains = {expert: gain(coverage, expert, load) for expert in range(num_experts)}
    best = sorted(range(num_experts), key=lambda e: (-gains[e][0], -gains[e][1], -gains[e][2], rank[e]))[:count]
    return Share(tuple(sorted(best)), sum(gains[e][0] for e in best), sum(gains[e][1] for e in best),
                 sum((gains[e][2] for e in best), Fraction(0)))


def experts_for_memory(memory_bytes: int, bytes_per_expert: int, num_experts: int) -> int:
    """How many experts (each `bytes_per_expert` over all MoE layers) fit in `memory_bytes`, at most
    all of them; MoeSwarmError when not even one does."""
    if bytes_per_expert <= 0:
        raise ValueError("bytes_per_expert must be positive")
    fits = memory_bytes // bytes_per_expert
    if fits < 1:
        raise MoeSwarmError(f"--memory gives {memory_bytes} bytes; one expert of this model takes "
                            f"{bytes_per_expert} bytes over its MoE layers")
    return int(min(fits, num_experts))


def joiner_order(seed: bytes, num_experts: int) -> list[int]:
    """A permutation of 0..E-1 drawn from `seed` (a joiner's own bytes: its DHT peer id)."""
    import hashlib

    return sorted(range(num_experts), key=lambda e: hashlib.sha256(seed + e.to_bytes(4, "big")).digest())


def _width(coverage: Coverage) -> int:
    widths = {len(holders) for holders in coverage.values()}
    if len(widths) != 1:
        raise ValueError("coverage must list the same experts for every layer, and at least one layer")
    return widths.pop()
