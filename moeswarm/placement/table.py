"""The placement table: from what holders announce to `layer -> expert -> candidate holders`.

A pure function of the announcements (as exo's `place_instance` and EPLB's functions are): it
reads no socket and keeps no state. Several candidates per expert are allowed (replicas, hot
experts on the backbone and a worker alike); the chooser (placement/chooser.py) picks one per
call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from moeswarm.ids import ExpertId, LayerId, WorkerId, format_ids


@dataclass(frozen=True)
class PlacementTable:
    """candidates[layer][expert]: the holders of that expert, in announcement order."""

    num_experts: int
    candidates: Mapping[LayerId, tuple[tuple[WorkerId, ...], ...]]

    def holders(self, layer: int, expert: int) -> tuple[WorkerId, ...]:
        per_layer = self.candidates.get(LayerId(layer))
        return () if per_layer is None else per_layer[expert]


def build_table(announced: Mapping[WorkerId, Mapping[int, Iterable[int]]], num_experts: int) -> PlacementTable:
    """announced: {holder: {layer: experts held}}, each expert id in [0, num_experts)."""
    lists: dict[LayerId, list[list[WorkerId]]] = {}
    for worker, held in announced.items():
        for layer, experts in held.items():
            per_layer = lists.setdefault(LayerId(layer), [[] for _ in range(num_experts)])
            for expert in experts:
                if not 0 <= expert < num_experts:
                    raise ValueError(f"holder {worker} announces layer {layer} expert {expert}: "
                                     f"the model has experts 0-{num_experts - 1}")
                per_layer[expert].append(worker)
    candidates = {layer: tuple(tuple(c) for c in per_layer) for layer, per_layer in sorted(lists.items())}
    return PlacementTable(num_experts, candidates)


def missing(table: PlacementTable, layers: Iterable[int]) -> dict[LayerId, list[ExpertId]]:
    """{layer: experts nobody holds}, for the layers that lack some."""
    gaps = {}
    for layer in layers:
        lacking = [ExpertId(e) for e in range(table.num_experts) if not table.holders(layer, e)]
        if lacking:
            gaps[LayerId(layer)] = lacking
    return gaps


def describe_gaps(gaps: Mapping[LayerId, list[ExpertId]]) -> str:
    """"layer 0 experts 4-7; layer 1 experts 3,9" for an error message."""
    return "; ".join(f"layer {layer} experts {format_ids(experts)}" for layer, experts in gaps.items())
