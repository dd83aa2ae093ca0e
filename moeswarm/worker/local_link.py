"""Experts held in the backbone's own process, behind the same link interface as a worker.

"This expert runs on the backbone" is then a placement decision: the dispatcher plans, sends and
combines exactly as for a remote worker. The holder computes when its reply is awaited, so the
fan-out's remote requests are already in flight while it runs. Tensors are not encoded: the
rows go to the experts as they are, which is what a lossless wire delivers too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.sources.loading import load_experts
from moeswarm.sources.source import ModelSource
from moeswarm.placement.profile import check_held
from moeswarm.transport.link import Pending, Reply
from moeswarm.wire.codecs import CODECS
from moeswarm.wire.messages import Dispatch, WorkerInfo
from moeswarm.worker.store import ExpertStore

LOCAL_ADDRESS = "local"


def hold_local(source: ModelSource, experts: Sequence[int] | Mapping[int, Sequence[int]] | None,
               moe_layers: Sequence[int], num_experts: int, hidden_size: int) -> ExpertStore | None:
    """Load the experts the backbone holds itself: the same ids for every MoE layer, or
    {layer: experts} (a layer may hold none). None when nothing is to be held."""
    if not experts:
        return None
    per_layer = dict(experts) if isinstance(experts, Mapping) else {layer: experts for layer in moe_layers}
    per_layer = {int(layer): tuple(sorted(set(int(e) for e in ids))) for layer, ids in per_layer.items()}
    check_held(per_layer, list(moe_layers), num_experts)
    by_set: dict[tuple[int, ...], list[int]] = {}  # one load per distinct expert set, over its layers
    for layer, ids in per_layer.items():
        if ids:
            by_set.setdefault(ids, []).append(layer)
    hosted = {}
    for ids, layers in by_set.items():
        for low, high in _runs(sorted(layers), sorted(moe_layers)):
            part, _, _ = load_experts(source, list(ids), (low, high))
            hosted.update(part)
    return ExpertStore(hosted, num_experts, hidden_size) if hosted else None


def _runs(layers: list[int], moe_layers: list[int]) -> list[tuple[int, int]]:
    """Inclusive ranges covering exactly `layers` among the MoE layers (load_experts takes a range)."""
    runs: list[list[int]] = []
    position = {layer: i for i, layer in enumerate(moe_layers)}
    for layer in layers:
        if runs and position[runs[-1][1]] + 1 == position[layer]:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return [(low, high) for low, high in runs]


class LocalLink:
    """store: anything with `held`, `num_experts`, `hidden_size` and `run(Dispatch) -> Result`."""

    def __init__(self, store, model_type: str = "local"):
        self.address = LOCAL_ADDRESS
        self.store = store
        self.model_type = model_type
        self.info: WorkerInfo | None = None
        self._queue: dict[int, Dispatch] = {}  # sent, not yet awaited
        self._next_id = 1

    @property
    def broken(self) -> bool:
        return False

    def connect(self, fingerprint: str) -> WorkerInfo:
        self.info = WorkerInfo(fingerprint, self.model_type, self.store.num_experts, self.store.hidden_size,
                               dict(self.store.held), tuple(sorted(CODECS)))
        return self.info

    def reconnect(self, timeout_s: float | None = None) -> WorkerInfo:
        assert self.info is not None
        return self.info

    def prepare(self, request: Dispatch) -> Dispatch:
        return request

    def send(self, request: Dispatch) -> Pending:
        self._next_id += 1
        self._queue[self._next_id] = request
        return Pending(self._next_id, 0, time.perf_counter())

    def fileno(self) -> None:
        """Nothing to select on: the reply is computed when it is awaited."""
        return None

    def has_reply(self, pending: Pending) -> bool:
        return True

    def forget(self, pending: Pending) -> None:
        self._queue.pop(pending.request_id, None)

    def wait(self, pending: Pending, deadline: float) -> Reply:
        request = self._queue.pop(pending.request_id, None)
        if request is None:
            raise WorkerError(self.address, f"request {pending.request_id} is not outstanding")
        try:
            result = self.store.run(request)
        except MoeSwarmError as error:
            raise WorkerError(self.address, str(error)) from None
        return Reply(result, 0, time.perf_counter() - pending.sent_at)

    def ping(self, timeout_s: float = 10.0) -> float:
        return 0.0

    def close(self) -> None:
        self._queue.clear()
