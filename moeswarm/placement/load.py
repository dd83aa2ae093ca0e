"""The swarm's measured load per (MoE layer, expert), from what its members announce.

Pure function over plain data: each member's held experts and, where it announces one, its load
(rows per minute of each held expert over its recent window: worker/served.py, discovery/record.py).
The result is the `load` that placement/share.py's `choose_share` and placement/rebalance.py weigh
pairs by.

    load[l][e] = (sum of the rates its measuring holders announce) * holders / measuring holders

(holders of one pair share its traffic: a holder that announces nothing is counted as serving the
average of those that do). A pair no holder measures (held only by members that announce no
load, or held by nobody) gets the mean of the measured pairs: unknown counts as typical, neither
hot nor cold. None when nothing is measured, or every measured rate is 0 (an idle swarm): then
every pair weighs 1, the rule before loads were announced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction

Held = Mapping[int, Sequence[int]]  # {MoE layer: experts}
Load = Mapping[int, Sequence[int]]  # {MoE layer: rows per minute of each expert of held[layer], in its order}


def swarm_load(members: Iterable[tuple[Held, Load | None]], layers: Sequence[int],
               num_experts: int) -> dict[int, list[int]] | None:
    """{layer: load of each expert} over the model's MoE `layers` (see the module's docstring), or None.

    members: (held, load or None) of each member; a load's layers outside `held`, or rates not
    matching its experts, are ignored (records are checked when read: discovery/record.py)."""
    wanted = set(layers)
    rates = {layer: [Fraction(0)] * num_experts for layer in layers}
    holders = {layer: [0] * num_experts for layer in layers}
    measuring = {layer: [0] * num_experts for layer in layers}
    for held, load in members:
        for layer, experts in held.items():
            if layer not in wanted:
                continue
            measured = None if load is None else load.get(layer)
            if measured is not None and len(measured) != len(experts):
                measured = None
            for position, expert in enumerate(experts):
                if not 0 <= expert < num_experts:
                    continue
                holders[layer][expert] += 1
                if measured is not None:
                    measuring[layer][expert] += 1
                    rates[layer][expert] += measured[position]
    known = [rates[layer][e] * holders[layer][e] / measuring[layer][e]
             for layer in layers for e in range(num_experts) if measuring[layer][e]]
    if not known or not any(known):
        return None
    mean = sum(known, Fraction(0)) / len(known)
    return {layer: [round(rates[layer][e] * holders[layer][e] / measuring[layer][e]) if measuring[layer][e]
                    else round(mean) for e in range(num_experts)] for layer in layers}
