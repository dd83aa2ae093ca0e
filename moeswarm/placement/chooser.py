"""Choosing one holder per (layer, expert) for a call.

Until failover lands the rule is simple: the first usable candidate in the table's order (a
local holder is listed first, so it wins over a remote replica). The result is the owner vector
that dispatch/plan.py splits a layer's routing by.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeswarm.ids import WorkerId
from moeswarm.placement.table import PlacementTable


def choose_owners(table: PlacementTable, layer: int, usable: Callable[[WorkerId], bool] = lambda _: True) -> torch.Tensor:
    """[E] long: the chosen holder of each expert of `layer`, -1 where no usable holder exists."""
    owner = torch.full((table.num_experts,), -1, dtype=torch.long)  # [E]
    for expert in range(table.num_experts):
        for worker in table.holders(layer, expert):
            if usable(worker):
                owner[expert] = worker
                break
    return owner
