"""The dispatcher: one MoE layer's rows out to the workers, their outputs back, combined.

`dispatch` sends and returns a handle at once; `combine` waits for the replies and adds them.
Between the two the caller may compute local work (shared experts, hot experts): the pair is
joined by the handle, as in DeepEP.

Fan-out `star` sends every involved worker its frame before reading any reply: one round trip
per layer, bounded by the slowest worker. `chain` waits for each worker before sending to the
next (for measurement: the sum of the round trips).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeswarm.dispatch.accounting import Accounting, LayerCall
from moeswarm.dispatch.combine import combine_exact, combine_partial
from moeswarm.dispatch.connection import WorkerConnection
from moeswarm.dispatch.plan import WorkerShare, plan_layer
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.wire.codecs import get_codec, lossless_codec
from moeswarm.wire.messages import COMBINE_MODES, Dispatch, Result

FANOUTS = ("star", "chain")


@dataclass
class Handle:
    layer: int
    hidden: torch.Tensor  # [T, d]
    top_k_index: torch.Tensor  # [T, k]
    shares: list[WorkerShare]
    pending: list[tuple[WorkerShare, int]]  # (share, request id) sent, not yet read
    results: list[tuple[WorkerShare, Result]]
    bytes_out: int
    bytes_in: int
    started: float
    worker_seconds: dict[str, float]
    round_trips: int


class Dispatcher:
    def __init__(self, workers: list[WorkerConnection], num_experts: int, fanout: str = "star",
                 mode: str = "exact", wire_dispatch: str | None = None, wire_combine: str | None = None):
        if fanout not in FANOUTS:
            raise MoeSwarmError(f"unknown fanout {fanout!r} (choose from {', '.join(FANOUTS)})")
        self.workers = workers
        self.num_experts = num_experts
        self.fanout = fanout
        self.configure(mode, wire_dispatch, wire_combine)
        self.accounting = Accounting()
        self._owners: dict[int, torch.Tensor] = {}
        self._placement()

    def configure(self, mode: str, wire_dispatch: str | None = None, wire_combine: str | None = None) -> None:
        """Choose the combine mode and the codecs (None: lossless) for the next dispatches."""
        if mode not in COMBINE_MODES:
            raise MoeSwarmError(f"unknown combine mode {mode!r} (choose from {', '.join(COMBINE_MODES)})")
        for codec in (wire_dispatch, wire_combine):
            if codec is not None:
                get_codec(codec)
        self.mode, self.wire_dispatch, self.wire_combine = mode, wire_dispatch, wire_combine

    def _placement(self) -> None:
        """owner[layer] = [E] worker index per expert, from what each worker said in HELLO."""
        for index, worker in enumerate(self.workers):
            info = worker.info
            for layer in info.layers:
                owner = self._owners.setdefault(layer, torch.full((self.num_experts,), -1, dtype=torch.long))
                taken = owner[info.experts] >= 0
                if taken.any():
                    raise MoeSwarmError(
                        f"workers {self.workers[int(owner[info.experts][taken][0])].address} and {worker.address} "
                        f"both hold layer {layer} expert {info.experts[int(taken.nonzero()[0])]}: ranges must be disjoint"
                    )
                owner[info.experts] = index

    def check_covers(self, layers: list[int]) -> None:
        """Every expert of every MoE layer must be held by some worker."""
        for layer in layers:
            owner = self._owners.get(layer)
            if owner is None or (owner < 0).any():
                missing = list(range(self.num_experts)) if owner is None else (owner < 0).nonzero().squeeze(1).tolist()
                raise MoeSwarmError(f"no worker holds layer {layer} experts {_compact(missing)}")

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Handle:
        """Send layer `layer`'s rows. hidden [T, d], top_k_index [T, k] long, top_k_weights [T, k]."""
        owner = self._owners.get(layer)
        if owner is None:
            raise MoeSwarmError(f"no worker serves MoE layer {layer}")
        shares = plan_layer(owner, top_k_index, top_k_weights)
        handle = Handle(layer, hidden, top_k_index, shares, [], [], 0, 0, time.perf_counter(), {}, 0)
        if self.fanout == "star":
            for share in shares:
                self._send(handle, share)
            handle.round_trips = 1 if shares else 0
        return handle

    def combine(self, handle: Handle) -> torch.Tensor:
        """Wait for the replies and add them into [T, d]."""
        try:
            if self.fanout == "chain":
                for share in handle.shares:
                    self._send(handle, share)
                    self._receive(handle)
                handle.round_trips = len(handle.shares)
            while handle.pending:
                self._receive(handle)
        except WorkerError:
            self._drain(handle)
            raise
        if self.mode == "exact":
            per_expert = {}
            for _, result in handle.results:
                for expert, block in zip(result.experts, torch.split(result.outputs, result.counts)):
                    per_expert[expert] = block
            out = combine_exact(handle.hidden, handle.top_k_index, per_expert)
        else:
            out = combine_partial(handle.hidden, [(share.tokens, result.outputs) for share, result in handle.results])
        self.accounting.record(
            LayerCall(handle.layer, handle.hidden.shape[0], handle.bytes_out, handle.bytes_in, handle.round_trips,
                      time.perf_counter() - handle.started, handle.worker_seconds)
        )
        return out

    def _drain(self, handle: Handle) -> None:
        """After one worker failed, read the other workers' replies so their streams stay in step."""
        while handle.pending:
            share, request_id = handle.pending.pop(0)
            try:
                self.workers[share.worker].receive(request_id)
            except WorkerError:
                pass

    def _send(self, handle: Handle, share: WorkerShare) -> None:
        worker = self.workers[share.worker]
        hidden = handle.hidden[share.tokens]  # [T_w, d]
        exact_codec = lossless_codec(hidden.dtype)
        request = Dispatch(handle.layer, hidden, share.top_k_index, share.top_k_weights, self.mode,
                           self.wire_dispatch or exact_codec, self.wire_combine or exact_codec)
        request_id, sent = worker.send(request.to_frame(worker.new_request_id()))
        handle.bytes_out += sent
        handle.pending.append((share, request_id))
        handle.worker_seconds[worker.address] = time.perf_counter()

    def _receive(self, handle: Handle) -> None:
        share, request_id = handle.pending.pop(0)
        worker = self.workers[share.worker]
        frame, received = worker.receive(request_id)
        handle.worker_seconds[worker.address] = time.perf_counter() - handle.worker_seconds[worker.address]
        handle.bytes_in += received
        try:
            result = Result.from_frame(frame)
        except MoeSwarmError as error:
            raise WorkerError(worker.address, f"bad RESULT: {error}") from None
        self._check_result(worker, share, handle, result)
        handle.results.append((share, result))

    def _check_result(self, worker: WorkerConnection, share: WorkerShare, handle: Handle, result: Result) -> None:
        expected = torch.unique(share.top_k_index[share.top_k_index >= 0]).tolist()
        if result.layer != handle.layer or result.mode != self.mode:
            raise WorkerError(worker.address, f"RESULT for layer {result.layer} ({result.mode}), asked layer {handle.layer} ({self.mode})")
        if self.mode == "exact":
            counts = [int((share.top_k_index == e).sum()) for e in expected]
            if result.experts != expected or result.counts != counts or result.outputs.shape[0] != sum(counts):
                raise WorkerError(worker.address, f"RESULT covers experts {result.experts} x {result.counts}, expected {expected} x {counts}")
        elif result.outputs.shape[0] != share.tokens.numel():
            raise WorkerError(worker.address, f"RESULT has {result.outputs.shape[0]} rows, expected {share.tokens.numel()}")
        if result.outputs.shape[1] != handle.hidden.shape[1]:
            raise WorkerError(worker.address, f"RESULT width {result.outputs.shape[1]}, expected {handle.hidden.shape[1]}")

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def _compact(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if values and values == list(range(values[0], values[-1] + 1)) else str(values)
