"""The dispatcher: one MoE layer's rows out to their holders, the outputs back, combined.

plan -> submit -> gather -> combine. `dispatch` plans the layer (who gets which rows), sends
every share and returns a handle at once; `combine` gathers the replies, checks them and adds them
up. Between the two the caller may compute local work (shared experts): the pair is joined by the
handle, as in DeepEP. Placement comes in as data (a table of candidates per expert); links are
anything that implements transport.link.WorkerLink.

Legend: T = tokens in the step, k = router top-k, d = hidden size, E = routed experts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeswarm.dispatch.accounting import Accounting, LayerCall
from moeswarm.dispatch.checks import result_problem
from moeswarm.dispatch.combine import combine_exact, combine_partial
from moeswarm.dispatch.plan import WorkerShare, plan_layer
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.ids import LayerId, WorkerId
from moeswarm.placement.chooser import choose_owners
from moeswarm.placement.table import PlacementTable, describe_gaps, missing
from moeswarm.transport import FANOUTS
from moeswarm.transport.fanout import Sent, gather, submit
from moeswarm.transport.link import Reply, WorkerLink
from moeswarm.wire.codecs import lossless_codec
from moeswarm.wire.config import EXACT, CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch

REPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Handle:
    """A layer in flight: what `combine` needs."""

    layer: LayerId
    hidden: torch.Tensor  # [T, d]
    top_k_index: torch.Tensor  # [T, k] long
    shares: tuple[WorkerShare, ...]
    requests: tuple[Dispatch, ...]  # one per share
    sent: tuple[Sent, ...]  # star: all of them; chain: none yet
    started: float  # time.perf_counter()


class Dispatcher:
    def __init__(self, links: Sequence[WorkerLink], table: PlacementTable, wire: WireConfig = EXACT,
                 fanout: str = "star", reply_timeout_s: float = REPLY_TIMEOUT_S):
        if fanout not in FANOUTS:
            raise MoeSwarmError(f"unknown fanout {fanout!r} (choose from {', '.join(FANOUTS)})")
        self.links = list(links)
        self.table = table
        self.wire = wire
        self.fanout = fanout
        self.reply_timeout_s = reply_timeout_s
        self.accounting = Accounting()
        self._owners: dict[LayerId, torch.Tensor] = {}  # [E] per layer, the chosen holder of each expert

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Handle:
        """Plan and send layer `layer`'s rows. hidden [T, d], top_k_index [T, k] long, top_k_weights [T, k]."""
        started = time.perf_counter()
        try:
            shares = tuple(plan_layer(self._owner(LayerId(layer)), top_k_index, top_k_weights))
        except LookupError as error:
            raise MoeSwarmError(f"layer {layer}: {error}") from None
        requests = tuple(self._request(layer, hidden, share) for share in shares)
        sent = tuple(submit(self.links, self._addressed(shares, requests))) if self.fanout == "star" else ()
        return Handle(LayerId(layer), hidden, top_k_index, shares, requests, sent, started)

    def combine(self, handle: Handle) -> torch.Tensor:
        """Gather the replies and add them into [T, d]."""
        sent, replies = self._gather(handle)
        for share, reply in zip(handle.shares, replies):
            problem = result_problem(share, handle.layer, self.wire.mode, handle.hidden.shape[1], reply.result)
            if problem:
                raise WorkerError(self.links[share.worker].address, problem)
        if self.wire.mode == CombineMode.EXACT:
            per_expert = {}  # {e: [n_e, d]}
            for reply in replies:
                result = reply.result
                for expert, block in zip(result.experts, torch.split(result.outputs, result.counts)):
                    per_expert[expert] = block
            out = combine_exact(handle.hidden, handle.top_k_index, per_expert)
        else:
            out = combine_partial(handle.hidden, [(s.tokens, r.result.outputs) for s, r in zip(handle.shares, replies)])
        self.accounting.record(LayerCall(
            handle.layer, handle.hidden.shape[0], sum(s.pending.bytes_out for s in sent), sum(r.bytes_in for r in replies),
            _round_trips(self.fanout, len(sent)), time.perf_counter() - handle.started,
            {self.links[s.worker].address: r.seconds for s, r in zip(handle.shares, replies)},
        ))
        return out

    def check_covers(self, layers: Sequence[int]) -> None:
        """Every expert of every MoE layer must have a holder."""
        gaps = missing(self.table, layers)
        if gaps:
            raise MoeSwarmError(f"no worker holds {describe_gaps(gaps)}")

    def close(self) -> None:
        for link in self.links:
            link.close()

    def _owner(self, layer: LayerId) -> torch.Tensor:
        if layer not in self._owners:
            if layer not in self.table.candidates:
                raise MoeSwarmError(f"no worker serves MoE layer {layer}")
            self._owners[layer] = choose_owners(self.table, layer)
        return self._owners[layer]

    def _request(self, layer: int, hidden: torch.Tensor, share: WorkerShare) -> Dispatch:
        lossless = lossless_codec(hidden.dtype)
        return Dispatch(layer, hidden[share.tokens], share.top_k_index, share.top_k_weights, self.wire.mode,  # [T_w, d]
                        self.wire.dispatch_codec or lossless, self.wire.combine_codec or lossless)

    @staticmethod
    def _addressed(shares: Sequence[WorkerShare], requests: Sequence[Dispatch]) -> list[tuple[WorkerId, Dispatch]]:
        return [(WorkerId(share.worker), request) for share, request in zip(shares, requests)]

    def _gather(self, handle: Handle) -> tuple[list[Sent], list[Reply]]:
        """(what was sent, the replies in share order): star awaits all at once, chain one by one."""
        if self.fanout == "star":
            return list(handle.sent), gather(self.links, handle.sent, time.monotonic() + self.reply_timeout_s)
        sent, replies = [], []
        for pair in self._addressed(handle.shares, handle.requests):
            sent += submit(self.links, [pair])
            replies += gather(self.links, sent[-1:], time.monotonic() + self.reply_timeout_s)
        return sent, replies


def _round_trips(fanout: str, sent: int) -> int:
    return sent if fanout == "chain" else min(sent, 1)
