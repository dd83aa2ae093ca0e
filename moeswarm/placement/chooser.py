"""Choosing one holder per (layer, expert) for a call.

The rule: a preferred holder (the backbone's own process) when it is usable; otherwise the
usable candidates take turns by expert id (expert e goes to candidate e mod n), so replicas
share the load instead of one copy serving everything and the other idling. The result is the
owner vector that dispatch/plan.py splits a layer's routing by; when a holder goes down or comes
back the dispatcher calls this again with a different `usable`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

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
