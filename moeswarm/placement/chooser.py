"""Choosing one holder per (layer, expert) for a call.

`choose_owners`, the rule for a whole layer: a preferred holder (the backbone's own process)
when it is usable; otherwise the usable candidates take turns by expert id (expert e goes to
candidate e mod n), so replicas share the load instead of one copy serving everything and the
other idling. The result is the owner vector that dispatch/plan.py splits a layer's routing by;
when a holder goes down or comes back the dispatcher calls this again with a different `usable`.

`choose_for_call`, the rule for one call where replicas sit at different distances: among a
replicated expert's holders, the ones that keep the call's slowest round trip lowest, and among
those the holders the call reaches anyway (fewer workers per call). The dispatcher uses it for
layers that have replicas; it is as pure as the other (the holders' round trips come in as data).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

import torch

from moeswarm.ids import WorkerId
from moeswarm.placement.table import PlacementTable


def choose_owners(table: PlacementTable, layer: int, usable: Callable[[WorkerId], bool] = lambda _: True,
                  preferred: Collection[WorkerId] = (), experts: Iterable[int] | None = None) -> torch.Tensor:
    """[E] long: the chosen holder of each expert of `layer`, -1 where no usable holder exists.

    experts: choose only these (the others stay -1); default all.
    """
    owner = torch.full((table.num_experts,), -1, dtype=torch.long)  # [E]
    for expert in range(table.num_experts) if experts is None else experts:
        candidates = [w for w in table.holders(layer, expert) if usable(w)]
        if candidates:
            first_choice = [w for w in candidates if w in preferred]
            owner[expert] = first_choice[0] if first_choice else candidates[expert % len(candidates)]
    return owner


# Holders within this much of the call's bound are as near as each other: measured times carry
# compute and scheduling noise (several ms on a busy machine), a choice must not flip on it, and
# replicas that near share the load by turns instead. WAN tiers apart by tens of ms stay apart.
RTT_TOLERANCE_S = 0.010
RTT_TOLERANCE_RATIO = 0.2


def choose_for_call(table: PlacementTable, layer: int, experts: Iterable[int],
                    rtt_s: Sequence[float | None], usable: Callable[[WorkerId], bool] = lambda _: True,
                    preferred: Collection[WorkerId] = ()) -> torch.Tensor:
    """[E] long: a holder for each of the call's routed `experts` (the others -1), chosen so that
    the call's slowest round trip is as short as the usable replicas allow, and through holders
    the call reaches anyway where it can.

    rtt_s: each holder's recent round trip in seconds (None: not measured yet, taken as 0 so
    that it gets measured). A star call waits for its slowest holder, so its best possible time
    is the largest, over the call's experts, of each expert's nearest holder's RTT (the bound).
    Every holder within the bound (and a tolerance) is as good for the call's time; among those
    an expert goes, in order, to a preferred holder (this process), to a holder the call reaches
    anyway (one that is the only holder within the bound of some other expert of the call), or
    else to those holders in turn by expert id, as `choose_owners` shares replicas out (equally
    near replicas still share the load).
    """
    owner = [-1] * table.num_experts  # [E], a tensor at the end: element writes to a tensor cost microseconds each
    rtt = lambda w: rtt_s[w] or 0.0  # noqa: E731
    candidates: dict[int, list[WorkerId]] = {}
    for expert in experts:
        usable_here = [w for w in table.holders(layer, expert) if usable(w)]
        first_choice = [w for w in usable_here if w in preferred]
        if first_choice:
            owner[expert] = first_choice[0]
        elif usable_here:
            candidates[expert] = usable_here
    if candidates:
        bound = max(min(rtt(w) for w in holders) for holders in candidates.values())
        slack = bound + max(RTT_TOLERANCE_S, RTT_TOLERANCE_RATIO * bound)
        near = {e: [w for w in holders if rtt(w) <= slack] for e, holders in candidates.items()}
        forced = {holders[0] for holders in near.values() if len(holders) == 1}  # the call reaches these anyway
        for expert, holders in near.items():
            reached = [w for w in holders if w in forced]
            owner[expert] = min(reached, key=rtt) if reached else holders[expert % len(holders)]
    return torch.tensor(owner, dtype=torch.long)


def has_choice(table: PlacementTable, layer: int) -> bool:
    """Whether some expert of `layer` has more than one holder (a per-call choice to make)."""
    return any(len(holders) > 1 for holders in table.candidates.get(layer, ()))
