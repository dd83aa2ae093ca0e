"""The dispatcher: one MoE layer's rows out to their holders, the outputs back, combined.

plan -> send -> gather -> combine. `dispatch` plans the layer (who gets which rows), sends
every share and returns a handle at once; `combine` gathers the replies (failing over, hedging
and spot-checking as dispatch/flight.py describes), checks them and adds them up. Between the
two the caller may compute local work (shared experts): the pair is joined by the handle, as in
DeepEP. Placement comes in as data (a table of candidates per expert); links are anything that
implements transport.link.WorkerLink; each holder's standing (round trips, deadline, backoff,
degraded, ban) lives in dispatch/health.py.

Layer calls are numbered (`call_number`, monotonic). The answers each call used without a spot
check confirming them are kept per holder (dispatch/taint.py); when a holder is banned, the calls
that used its unchecked answers become a `Taint` (`take_taints`), for the engine to roll back.
Holders that left the swarm stay as tombstones for `prune_after_s`, then are dropped (indices
are renumbered between layer calls, never while one is in flight).

Legend: T = tokens in the step, k = router top-k, d = hidden size, E = routed experts.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moeswarm.dispatch.accounting import Accounting, LayerCall, Resilience
from moeswarm.dispatch.combine import combine_exact, combine_partial
from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.flight import Flight
from moeswarm.dispatch.plausible import NormGate
from moeswarm.dispatch.health import REPLY_TIMEOUT_S, DeadlinePolicy, Holder
from moeswarm.dispatch.membership import JOIN, LEFT_CAUSE, MembershipQueue
from moeswarm.dispatch.plan import WorkerShare, plan_layer
from moeswarm.dispatch.spot_check import SpotChecker, SpotCheckPolicy
from moeswarm.dispatch.taint import Ledger, Taint
from moeswarm.dispatch.verify import REFEREE
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.ids import LayerId, WorkerId
from moeswarm.placement.chooser import choose_for_call, choose_owners, has_choice
from moeswarm.placement.profile import RoutingStats
from moeswarm.placement.table import PlacementTable, build_table, describe_gaps, missing
from moeswarm.transport import FANOUTS
from moeswarm.transport.link import WorkerLink
from moeswarm.transport.local import LOCAL_ADDRESS
from moeswarm.wire.codecs import lossless_codec
from moeswarm.wire.config import EXACT, CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch, Result

PRUNE_AFTER_S = 600.0  # how long a holder that left stays a tombstone
PRUNE_AT = 64  # ... unless this many tombstones accumulate first

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
    call: int = 0  # the layer call's number (Dispatcher.call_number)


class Dispatcher:
    def __init__(self, links: Sequence[WorkerLink], table: PlacementTable, wire: WireConfig = EXACT,
                 fanout: str = "star", reply_timeout_s: float = REPLY_TIMEOUT_S, policy: DeadlinePolicy | None = None,
                 spot_checks: SpotCheckPolicy | None = None, referee: Callable[[Dispatch], Result] | None = None):
        """referee: the backbone computing a request itself (dispatch/referee.py), to settle a
        dispute between two holders when no third holder can; None: only holders settle."""
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
        self.routing = RoutingStats(table.num_experts)  # live routing counts (placement/profile.py)
        self._owners: dict[LayerId, torch.Tensor] = {}  # [E] per layer, for the usable holders of `_owners_for`
        self._owners_for: tuple[bool, ...] = ()
        self._choices: dict[LayerId, bool] = {}  # per layer: has replicas, so each call chooses (`_owner`)
        self.gone: set[WorkerId] = set()  # holders that left the swarm: tombstones, never usable again
        self._gone_at: dict[WorkerId, float] = {}  # time.monotonic() each left
        self.prune_after_s = PRUNE_AFTER_S
        self._membership = MembershipQueue()
        self.referee = referee
        self.referee_error: str | None = None  # why the referee last failed
        self.gate = NormGate()  # plausibility of each answer's row norms (dispatch/plausible.py)
        self.call_number = 0  # layer calls started so far
        self.ledger = Ledger()  # per holder: the calls that used its unchecked answers
        self._taints: list[Taint] = []  # bans not yet taken
        self._flights: weakref.WeakSet[Flight] = weakref.WeakSet()  # dispatched, not yet combined (or dropped)
        self._oldest_gone = float("inf")  # time.monotonic() the oldest tombstone left

    @property
    def reply_timeout_s(self) -> float:
        return self.policy.cap_s

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Handle:
        """Plan and send layer `layer`'s rows. hidden [T, d], top_k_index [T, k] long, top_k_weights [T, k]."""
        started = time.perf_counter()
        if self._membership:
            self.apply_membership()
        elif time.monotonic() - self._oldest_gone >= self.prune_after_s and not self._flights:
            self._prune()
        self.readmit(due_only=True)
        layer = LayerId(layer)
        shares = self._plan(layer, top_k_index, top_k_weights)
        self.routing.update(layer, top_k_index, top_k_weights)
        self.call_number += 1
        flight = Flight(self, layer, hidden, top_k_index)
        flight.start(shares, chain=self.fanout == "chain")
        if flight.error is not None:
            flight.abort()
        remote = sum(1 for share in shares if share.worker not in self.trusted)  # a local holder makes no trip
        round_trips = remote if self.fanout == "chain" else min(remote, 1)
        self._flights.add(flight)
        return Handle(layer, hidden, top_k_index, flight, round_trips, started, self.call_number)

    def combine(self, handle: Handle) -> torch.Tensor:
        """Gather the replies and add them into [T, d]."""
        flight = handle.flight
        try:
            flight.run(chain=self.fanout == "chain")
        finally:
            self._flights.discard(flight)
        answers = flight.answers()  # [(share, reply, holder)]
        for holder in flight.unchecked():
            self.ledger.used(holder, handle.call)
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
            {self.address_of(holder): reply.seconds for _, reply, holder in answers},
            _rows(share.tokens for share, _, holder in answers if holder not in self.trusted and holder != REFEREE),
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
            return plan_layer(self._owner(layer, top_k_index), top_k_index, top_k_weights)
        except LookupError:
            pass
        lacking = sorted(set(top_k_index[self._owner(layer)[top_k_index] < 0].tolist()))
        down = sorted({w for e in lacking for w in self.table.holders(layer, e) if not self.holders[w].banned})
        for worker in down:  # a last resort before failing the call: probe them now, backoff or not
            self.probe(worker)
        try:
            return plan_layer(self._owner(layer, top_k_index), top_k_index, top_k_weights)
        except LookupError:
            pass
        lacking = sorted(set(top_k_index[self._owner(layer)[top_k_index] < 0].tolist()))
        holders = sorted({w for e in lacking for w in self.table.holders(layer, e)})
        worker = holders[0] if holders else None
        cause = self.holders[worker].cause if worker is not None else "no holder"
        address = self.links[worker].address if worker is not None else "none"
        raise ExpertsUnavailable(address, cause or "out of use", layer, lacking)

    def _owner(self, layer: LayerId, top_k_index: torch.Tensor | None = None) -> torch.Tensor:
        """[E] holder per expert: the layer's cached choice; for a layer with replicas and a call's
        routing top_k_index [T, k], the choice for that call's experts by the holders' measured
        round trips (placement/chooser.py `choose_for_call`)."""
        usable = tuple(h.usable + 2 * h.degraded for h in self.holders)
        if usable != self._owners_for:
            self._owners, self._owners_for, self._choices = {}, usable, {}
        fit = lambda w: self.holders[w].usable and not self.holders[w].degraded  # noqa: E731
        if layer not in self._owners:  # degraded holders only where nobody else holds the expert
            owners = choose_owners(self.table, layer, fit, self.trusted)  # [E]
            fallback = choose_owners(self.table, layer, lambda w: self.holders[w].usable, self.trusted)  # [E]
            self._owners[layer] = torch.where(owners >= 0, owners, fallback)
            self._choices[layer] = has_choice(self.table, layer)
        if top_k_index is None or not self._choices[layer]:
            return self._owners[layer]
        rtt_s = [h.round_trips.quantile(0.5, 1) if len(h.round_trips) >= self.policy.min_samples else None
                 for h in self.holders]  # a few samples (a prefill's) say little: unmeasured until then
        experts = torch.unique(top_k_index[top_k_index >= 0]).tolist()
        owners = torch.as_tensor(choose_for_call(self.table, layer, experts, rtt_s, fit, self.trusted))  # [E]
        if bool((owners[experts] < 0).any()):  # some expert held only by degraded holders
            fallback = choose_for_call(self.table, layer, experts, rtt_s, lambda w: self.holders[w].usable, self.trusted)
            owners = torch.where(owners >= 0, owners, torch.as_tensor(fallback))
        return owners

    # -- holders joining and leaving (dispatch/membership.py) -----------------------------

    def add_link(self, link: WorkerLink) -> None:
        """Queue a connected link (HELLO done) as a new holder; thread-safe, applied between layer calls."""
        self._membership.join(link)

    def remove_link(self, link: WorkerLink) -> None:
        """Queue the holder of `link` to leave: its experts go to the other holders; thread-safe."""
        self._membership.leave(link)

    def apply_membership(self) -> None:
        """Apply the queued joins and leaves, then rebuild the placement table over the members.

        Call only where no layer call is in flight: `dispatch` does at its start."""
        for change in self._membership.take():
            if change.kind == JOIN:
                self.links.append(change.link)
                self.holders.append(Holder(self.policy))
                if change.link.address == LOCAL_ADDRESS:
                    self.trusted.add(WorkerId(len(self.links) - 1))
                continue
            worker = next((WorkerId(i) for i, link in enumerate(self.links) if link is change.link), None)
            if worker is None or worker in self.gone:
                continue
            self.gone.add(worker)
            self._gone_at[worker] = time.monotonic()
            holder = self.holders[worker]
            holder.up, holder.cause = False, LEFT_CAUSE
            change.link.close()
        if not self._flights:
            self._prune()
        held = {WorkerId(i): link.info.held for i, link in enumerate(self.links) if i not in self.gone and link.info}
        self.table = build_table(held, self.table.num_experts)
        self._owners, self._owners_for, self._choices = {}, (), {}  # every cached choice was over the old table

    def _prune(self) -> None:
        """Drop the tombstones older than `prune_after_s` (all of them past `PRUNE_AT`): their links,
        standing and ledger; the other holders are renumbered. Only with no layer call in flight."""
        now = time.monotonic()
        due = {w for w in self.gone if now - self._gone_at.get(w, now) >= self.prune_after_s or len(self.gone) >= PRUNE_AT}
        if due:
            self._drop(due)
        self._oldest_gone = min(self._gone_at.values(), default=float("inf"))

    def _drop(self, due: set[WorkerId]) -> None:
        keep = [i for i in range(len(self.links)) if i not in due]
        renumber = {WorkerId(old): WorkerId(new) for new, old in enumerate(keep)}
        for worker in due:
            self.links[worker].close()
        self.links = [self.links[i] for i in keep]
        self.holders = [self.holders[i] for i in keep]
        self.trusted = {renumber[w] for w in self.trusted if w in renumber}
        self.gone = {renumber[w] for w in self.gone if w in renumber}
        self._gone_at = {renumber[w]: t for w, t in self._gone_at.items() if w in renumber}
        self.ledger.rekey(renumber)
        self.table = build_table({WorkerId(i): link.info.held for i, link in enumerate(self.links)
                                  if i not in self.gone and link.info}, self.table.num_experts)
        self._owners, self._owners_for, self._choices = {}, (), {}
        self.stats.pruned += len(due)

    def members(self) -> list[WorkerLink]:
        """The links of the holders that have not left (joins still queued are not counted)."""
        return [link for i, link in enumerate(self.links) if i not in self.gone]

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
        self._taints.append(Taint(self.links[worker].address, cause, self.ledger.runs(worker)))
        self.ledger.forget(worker)

    def take_taints(self) -> list[Taint]:
        """The bans since the last take, each with the layer calls that used the liar's unchecked
        answers (to roll back every sequence from its first such step)."""
        taints, self._taints = self._taints, []
        return taints

    def address_of(self, worker: int) -> str:
        return LOCAL_ADDRESS if worker == REFEREE else self.links[worker].address

    def probe(self, worker: int) -> bool:
        """Reconnect a down holder (HELLO, same experts) and PING it; readmit it on success."""
        holder, link = self.holders[worker], self.links[worker]
        if holder.banned or worker in self.gone:
            return False
        try:
            link.reconnect(self.policy.probe_timeout_s)
            holder.ping_s = link.ping(self.policy.probe_timeout_s)
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
            if not holder.up and not holder.banned and worker not in self.gone and (not due_only or holder.retry_at <= now):
                self.probe(worker)

    def health(self, layers: Sequence[int], timeout_s: float) -> list[str]:
        """What stops a forward now ([] when ready): holders out of use whose experts nobody else
        serves, and those experts. Probes down holders that are due (and, when some experts have no
        usable holder, their holders at once), pings the others."""
        self.readmit(due_only=True)
        for worker, (link, holder) in enumerate(zip(self.links, self.holders)):
            if holder.usable:
                try:
                    holder.ping_s = link.ping(timeout_s)
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
               for i, (link, h) in enumerate(zip(self.links, self.holders)) if not h.usable and i not in self.gone]
        return out + [f"no usable worker holds {describe_gaps(gaps)}"]

    def _gaps(self, layers: Sequence[int]) -> dict:
        usable = {WorkerId(i): link.info.held for i, (link, h) in enumerate(zip(self.links, self.holders)) if h.usable}
        return missing(build_table(usable, self.table.num_experts), layers)

    def standing(self) -> list[dict]:
        """Per holder: up, banned, degraded (losing hedges or missing deadlines), failures, cause,
        PING and round-trip quantiles (ms)."""
        return [{"worker": link.address, "up": h.up, "banned": h.banned, "degraded": h.degraded, "failures": h.failures,
                 "cause": h.cause, "ping_ms": None if h.ping_s is None else 1000 * h.ping_s,
                 "rtt_ms": h.round_trips.summary_ms()} for link, h in zip(self.links, self.holders)]

    def check_covers(self, layers: Sequence[int]) -> None:
        """Every expert of every MoE layer must have a holder."""
        gaps = missing(self.table, layers)
        if gaps:
            raise MoeSwarmError(f"no worker holds {describe_gaps(gaps)}")

    def close(self) -> None:
        if self._membership:
            self.apply_membership()  # links joined since the last layer call are closed too
        for link in self.links:
            link.close()


def _rows(tokens) -> int:
    """How many distinct rows of the step these [T_w] token index tensors cover."""
    tokens = [t.numpy() for t in tokens]
    if len(tokens) <= 1:
        return len(tokens[0]) if tokens else 0  # a share's tokens are distinct
    return len(np.unique(np.concatenate(tokens)))
