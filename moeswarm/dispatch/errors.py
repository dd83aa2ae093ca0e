"""The dispatcher's own error: some experts of a layer have no usable holder left."""

from __future__ import annotations

from collections.abc import Sequence

from moeswarm.errors import WorkerError
from moeswarm.ids import format_ids


class ExpertsUnavailable(WorkerError):
    """`experts` of `layer` have no usable holder: `worker` (the last that held them) failed.

    A server fails only the requests routed to those experts (attributes `layer`, `experts`).
    """

    def __init__(self, worker: str, cause: str, layer: int, experts: Sequence[int]):
        super().__init__(worker, f"{cause}; layer {layer} experts {format_ids(sorted(experts))} have no other usable holder")
        self.layer = layer
        self.experts = sorted(experts)
