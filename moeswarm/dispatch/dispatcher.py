"""The dispatcher: one MoE layer's rows out to their holders, the outputs back, combined.

plan -> send -> gather -> combine. `dispatch` plans the layer (who gets which rows), sends
every share and returns a handle at once; `combine` gathers the replies (failing over, hedging
and spot-checking as dispatch/flight.py describes), checks them and adds them up. Between the
two the caller may compute local work (shared experts): the pair is joined by the handle, as in
DeepEP. Placement comes in as data (a table of candidates per expert); links are anything that
implements transport.link.WorkerLink; each holder's standing (round trips, deadline, backoff,
ban) lives in dispatch/health.py.

Legend: T = tokens in the step, k = router top-k, d = hidden size, E = routed experts.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from moeswarm.dispatch.accounting import Accounting, LayerCall, Resilience
from moeswarm.dispatch.combine import combine_exact, combine_partial
from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.flight import Flight
from moeswarm.dispatch.health import REPLY_TIMEOUT_S, DeadlinePolicy, Holder
from moeswarm.dispatch.plan import WorkerShare, plan_layer
from moeswarm.dispatch.spot_check import SpotChecker, SpotCheckPolicy
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.ids import LayerId, WorkerId
from moeswarm.placement.chooser import choose_owners
from moeswarm.placement.table import PlacementTable, build_table, describe_gaps, missing
from moeswarm.transport import FANOUTS
from moeswarm.transport.link import WorkerLink
from moeswarm.transport.local import LOCAL_ADDRESS
from moeswarm.wire.codecs import lossless_codec
from moeswarm.wire.config import EXACT, CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch

__all__ = ["REPLY_TIMEOUT_S", "Dispatcher", "Handle"]


@dataclass(frozen=True)
class Handle:
    """A layer in flight: what `combine` needs."""

    layer: LayerId
    hidden: torch.Tensor  # [T, d]
    top_k_index: torch.Tensor  # [T, k] long
    flight: Flight
    round_trips: int
    started: float  # time.perf_counter()


class Dispatcher:
    def __init__(self, links: Sequence[WorkerLink], table: PlacementTable, wire: WireConfig = EXACT,
                 fanout: str = "star", reply_timeout_s: float = REPLY_TIMEOUT_S, policy: DeadlinePolicy | None = None,
                 spot_checks: SpotCheckPolicy | None = None):
        if fanout not in FANOUTS:
            raise MoeSwarmError(f"unknown fanout {fanout!r} (choose from {', '.join(FANOUTS)})")
        self.links = list(links)
        self.table = table
        self.wire = wire
        self.fanout = fanout
        self.policy = policy or DeadlinePolicy(cap_s=reply_timeout_s)
        self.holders = [Holder(self.policy) for _ in self.links]
        self.trusted = {WorkerId(i) for i, link in enumerate(self.links) if link.address == LOCAL_ADDRESS}
        self.checker = SpotChecker(spot_checks or SpotCheckPolicy())
        self.accounting = Accounting()
        self.stats = Resilience()
        self._owners: dict[LayerId, torch.Tensor] = {}  # [E] per layer, for the usable holders of `_owners_for`
        self._owners_for: tuple[bool, ...] = ()

    @property
    def reply_timeout_s(self) -> float:
        return self.policy.cap_s

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Handle:
        """Plan and send layer `layer`'s rows. hidden [T, d], top_k_index [T, k] long, top_k_weights [T, k]."""
        started = time.perf_counter()
        self.readmit(due_only=True)
        layer = LayerId(layer)
        shares = self._plan(layer, top_k_index, top_k_weights)
        flight = Flight(self, layer, hidden, top_k_index)
        flight.start(shares, chain=self.fanout == "chain")
        if flight.error is not None:
            flight.abort()
        round_trips = len(shares) if self.fanout == "chain" else min(len(shares), 1)
        return Handle(layer, hidden, top_k_index, flight, round_trips, started)

    def combine(self, handle: Handle) -> torch.Tensor:
        """Gather the replies and add them into [T, d]."""
        flight = handle.flight
        flight.run(chain=self.fanout == "chain")
        answers = flight.answers()  # [(share, reply, holder)]
        if self.wire.mode == CombineMode.EXACT:
            per_expert = {}  # {e: [n_e, d]}
            for _, reply, _ in answers:
                result = reply.result
                for expert, block in zip(result.experts, torch.split(result.outputs, result.counts)):
                    per_expert[expert] = block
            out = combine_exact(handle.hidden, handle.top_k_index, per_expert)
        else:
            out = combine_partial(handle.hidden, [(share.tokens, reply.result.outputs) for share, reply, _ in answers])
        self.accounting.record(LayerCall(
            handle.layer, handle.hidden.shape[0], flight.bytes_out, flight.bytes_in, handle.round_trips,
            time.perf_counter() - handle.started,
            {self.links[holder].address: reply.seconds for _, reply, holder in answers},
        ))
        return out

    # -- placement over the usable holders -------------------------------------------------

    def choose(self, layer: int, experts: Sequence[int], exclude: Collection[int] = ()) -> torch.Tensor:
        """[E] long: a usable holder for each of `experts` outside `exclude` (-1: none)."""
        return choose_owners(self.table, layer, lambda w: self.holders[w].usable and w not in exclude,
                             self.trusted, experts)

    def replica_for(self, layer: int, experts: Sequence[int], exclude: Collection[int]) -> int | None:
        """A usable holder of every one of `experts`, outside `exclude` (for a hedged duplicate)."""
        common = None
        for expert in experts:
            here = {w for w in self.table.holders(layer, expert) if self.holders[w].usable and w not in exclude}
            common = here if common is None else common & here
        return min(common) if common else None

    def request(self, layer: int, hidden: torch.Tensor, share: WorkerShare) -> Dispatch:
        lossless = lossless_codec(hidden.dtype)
        return Dispatch(layer, hidden[share.tokens], share.top_k_index, share.top_k_weights, self.wire.mode,  # [T_w, d]
                        self.wire.dispatch_codec or lossless, self.wire.combine_codec or lossless)

    def _plan(self, layer: LayerId, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> list[WorkerShare]:
        if layer not in self.table.candidates:
            raise MoeSwarmError(f"no worker serves MoE layer {layer}")
        try:
            return plan_layer(self._owner(layer), top_k_index, top_k_weights)
        except LookupError:
            pass
        lacking = sorted(set(top_k_index[self._owner(layer)[top_k_index] < 0].tolist()))
        down = sorted({w for e in lacking for w in self.table.holders(layer, e) if not self.holders[w].banned})
        for worker in down:  # a last resort before failing the call: probe them now, backoff or not
            self.probe(worker)
        try:
            return plan_layer(self._owner(layer), top_k_index, top_k_weights)
        except LookupError:
            pass
        lacking = sorted(set(top_k_index[self._owner(layer)[top_k_index] < 0].tolist()))
        holders = sorted({w for e in lacking for w in self.table.holders(layer, e)})
        worker = holders[0] if holders else None
        cause = self.holders[worker].cause if worker is not None else "no holder"
        address = self.links[worker].address if worker is not None else "none"
        raise ExpertsUnavailable(address, cause or "out of use", layer, lacking)

    def _owner(self, layer: LayerId) -> torch.Tensor:
        usable = tuple(h.usable for h in self.holders)
        if usable != self._owners_for:
            self._owners, self._owners_for = {}, usable
        if layer not in self._owners:
            self._owners[layer] = choose_owners(self.table, layer, lambda w: self.holders[w].usable, self.trusted)
        return self._owners[layer]

    # -- holders' standing -----------------------------------------------------------------

    def take_down(self, worker: WorkerId, cause: str) -> None:
        """`worker` failed: close its link and keep it out of use until a probe succeeds."""
        holder = self.holders[worker]
        self.links[worker].close()
        if holder.up and not holder.banned:
            holder.fail(time.monotonic(), cause)
            self.stats.takedowns += 1

    def ban(self, worker: WorkerId, cause: str) -> None:
        """`worker` lied: never used again in this session."""
        self.holders[worker].ban(cause)
        self.links[worker].close()
        self.stats.bans += 1

    def probe(self, worker: int) -> bool:
        """Reconnect a down holder (HELLO, same experts) and PING it; readmit it on success."""
        holder, link = self.holders[worker], self.links[worker]
        if holder.banned:
            return False
        try:
            link.reconnect(self.policy.probe_timeout_s)
            link.ping(self.policy.probe_timeout_s)
        except (MoeSwarmError, OSError) as error:
            link.close()
            holder.up = True  # fail() counts the failure and doubles the backoff
            holder.fail(time.monotonic(), getattr(error, "cause", None) or str(error))
            return False
        holder.readmit()
        self.stats.readmissions += 1
        return True

    def readmit(self, due_only: bool = True) -> None:
        """Probe the down holders whose backoff has run out (all of them: due_only=False)."""
        now = time.monotonic()
        for worker, holder in enumerate(self.holders):
            if not holder.up and not holder.banned and (not due_only or holder.retry_at <= now):
                self.probe(worker)

    def health(self, layers: Sequence[int], timeout_s: float) -> list[str]:
        """What stops a forward now ([] when ready): holders out of use whose experts nobody else
        serves, and those experts. Probes down holders that are due (and, when some experts have no
        usable holder, their holders at once), pings the others."""
        self.readmit(due_only=True)
        for worker, (link, holder) in enumerate(zip(self.links, self.holders)):
            if holder.usable:
                try:
                    link.ping(timeout_s)
                except (MoeSwarmError, OSError) as error:
                    self.take_down(WorkerId(worker), getattr(error, "cause", None) or str(error))
        gaps = self._gaps(layers)
        if gaps:  # as in a layer call: when nobody else can serve, probe now, backoff or not
            holders = {w for layer, experts in gaps.items() for e in experts for w in self.table.holders(layer, e)}
            for worker in sorted(holders):
                if not self.holders[worker].usable:
                    self.probe(worker)
            gaps = self._gaps(layers)
        if not gaps:
            return []
        out = [str(WorkerError(link.address, ("banned: " if h.banned else "down: ") + h.cause))
               for link, h in zip(self.links, self.holders) if not h.usable]
        return out + [f"no usable worker holds {describe_gaps(gaps)}"]

    def _gaps(self, layers: Sequence[int]) -> dict:
        usable = {WorkerId(i): link.info.held for i, (link, h) in enumerate(zip(self.links, self.holders)) if h.usable}
        return missing(build_table(usable, self.table.num_experts), layers)

    def standing(self) -> list[dict]:
        """Per holder: up, banned, failures, cause, round-trip quantiles (ms)."""
        return [{"worker": link.address, "up": h.up, "banned": h.banned, "failures": h.failures, "cause": h.cause,
                 "rtt_ms": h.round_trips.summary_ms()} for link, h in zip(self.links, self.holders)]

    def check_covers(self, layers: Sequence[int]) -> None:
        """Every expert of every MoE layer must have a holder."""
        gaps = missing(self.table, layers)
        if gaps:
            raise MoeSwarmError(f"no worker holds {describe_gaps(gaps)}")

    def close(self) -> None:
        for link in self.links:
            link.close()
