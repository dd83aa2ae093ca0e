"""The dispatcher: one MoE layer's rows out to their holders, the outputs back, combined.

plan -> send -> gather -> combine. `dispatch` plans the layer (who gets which rows), sends
every share and returns a handle at once; `combine` gathers the replies (failing over, hedging
and spot-checking as dispatch/flight.py describes), checks them and adds them up. Between the
two the caller may compute local work (shared experts): the pair is joined by the handle, as in
DeepEP. A decode step's call that can meet none of a flight's cases goes express
(dispatch/express_call.py): the same requests and checks without the flight's bookkeeping, made again
as a flight when anything goes wrong.

Its collaborators, each held and called, none reaching into another:
- the holder pool (dispatch/pool.py): links, standing, the placement table; choose, probe, take
  down, ban; members joining and leaving (queued from any thread through `change_members`,
  applied between layer calls; tombstones pruned after `prune_after_s`, renumbering holders);
- the owners (dispatch/owners.py): the plan of a call over the usable holders;
- verification (dispatch/verify.py): spot checks, plausibility, who lied;
- a `Flight` per layer call (dispatch/flight.py) between `dispatch` and `combine`.

Layer calls are numbered (`call_number`, monotonic). The answers each call used without a spot
check confirming them are kept per holder (dispatch/taint.py); when a holder is banned, the calls
that used its unchecked answers become a `Taint` (`take_taints`), for the engine to roll back.

Legend: T = tokens in the step, k = router top-k, d = hidden size, E = routed experts.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moeswarm.dispatch.accounting import Accounting, LayerCall, Resilience
from moeswarm.dispatch.combine import combine_exact, combine_partial, combine_token
from moeswarm.dispatch import express_call as express
from moeswarm.dispatch.flight import Flight, share_request
from moeswarm.dispatch.health import REPLY_TIMEOUT_S, DeadlinePolicy
from moeswarm.dispatch.lane import Lane, LaneAnswer, LaneCall
from moeswarm.dispatch.membership import JOIN, LEFT_CAUSE, Change, MembershipQueue
from moeswarm.dispatch.owners import Owners
from moeswarm.dispatch.parts import REFEREE
from moeswarm.dispatch.pool import PRUNE_AT, HolderPool
from moeswarm.dispatch.spot_check import SpotChecker, SpotCheckPolicy
from moeswarm.dispatch.taint import Taint
from moeswarm.dispatch.verify import Verification
from moeswarm.dispatch.wait import WaitPolicy
from moeswarm.errors import MoeSwarmError
from moeswarm.ids import LayerId
from moeswarm.placement.profile import RoutingStats
from moeswarm.placement.table import PlacementTable, describe_gaps, missing
from moeswarm.transport import FANOUTS
from moeswarm.transport.link import WorkerLink
from moeswarm.worker.local_link import LOCAL_ADDRESS
from moeswarm.kernels import qkernels
from moeswarm.wire.config import EXACT, CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch, Result

__all__ = ["PRUNE_AT", "REPLY_TIMEOUT_S", "Dispatcher", "Handle"]


@dataclass(frozen=True)
class Handle:
    """A layer in flight: what `combine` needs."""

    layer: LayerId
    hidden: torch.Tensor  # [T, d]
    top_k_index: torch.Tensor  # [T, k] long
    flight: Flight | express.ExpressCall | LaneCall
    round_trips: int
    started: float  # time.perf_counter()
    call: int = 0  # the layer call's number (Dispatcher.call_number)


class Dispatcher:
    def __init__(self, links: Sequence[WorkerLink], table: PlacementTable, wire: WireConfig = EXACT,
                 fanout: str = "star", reply_timeout_s: float = REPLY_TIMEOUT_S, policy: DeadlinePolicy | None = None,
                 spot_checks: SpotCheckPolicy | None = None, referee: Callable[[Dispatch], Result] | None = None,
                 routing: RoutingStats | None = None, paths: Mapping[str, str] | None = None):
        """links: the holders, connected (HELLO done); table: the placement over their announced experts.
        referee: the backbone computing a request itself (dispatch/referee.py), to settle a
        dispute between two holders when no third holder can; None: only holders settle.
        routing: where live routing counts go (placement/profile.py; a fresh one when None).
        paths: {worker address: "direct" or "relay"} for the accounting (transport/path.py)."""
        if fanout not in FANOUTS:
            raise MoeSwarmError(f"unknown fanout {fanout!r} (choose from {', '.join(FANOUTS)})")
        self.wire = wire
        self.fanout = fanout
        self.policy = policy or DeadlinePolicy(cap_s=reply_timeout_s)
        self.stats = Resilience()
        self.pool = HolderPool(links, table, self.policy, self.stats)
        self.owners = Owners(self.pool)
        self.lane = Lane(self.pool)  # a decode step's calls in C where they may go express (dispatch/lane.py)
        self.wait = WaitPolicy()  # whether a lane call spins for its replies (dispatch/wait.py)
        self.verification = Verification(self.pool, SpotChecker(spot_checks or SpotCheckPolicy()), self.stats, referee)
        self._accounting = Accounting(paths=dict(paths or {}))
        self._unsettled: tuple | None = None  # the last lane call's bookkeeping (`settle`)
        self.routing = routing or RoutingStats(table.num_experts)  # live routing counts
        self.call_number = 0  # layer calls started so far
        self._membership = MembershipQueue()
        self._flights: weakref.WeakSet[Flight] = weakref.WeakSet()  # dispatched, not yet combined (or dropped)

    # the pool's state, read-only here (the dashboard, the swarm and tests read it)
    links = property(lambda self: self.pool.links)
    table = property(lambda self: self.pool.table)
    trusted = property(lambda self: self.pool.trusted)
    gone = property(lambda self: self.pool.gone)

    @property
    def prune_after_s(self) -> float:
        return self.pool.prune_after_s

    @prune_after_s.setter
    def prune_after_s(self, seconds: float) -> None:
        self.pool.prune_after_s = seconds

    @property
    def reply_timeout_s(self) -> float:
        return self.policy.cap_s

    def configure(self, wire: WireConfig) -> None:
        """Use `wire` from the next layer call on (a call in flight keeps its own)."""
        self.wire = wire

    @property
    def holders(self) -> list:
        """The holders' standing (every lane call's round trips recorded)."""
        self.settle()
        return self.pool.holders

    @property
    def accounting(self) -> Accounting:
        """The layer calls so far and the traffic they made (every lane call settled)."""
        self.settle()
        return self._accounting

    def settle(self) -> None:
        """Record the last lane call's bookkeeping (round trips, plausibility statistics, accounting).
        A lane call leaves it for the next call to make once its DISPATCHes are out, while its holders
        compute; everything that reads or changes the holders' standing settles first. Only the
        thread that made the call records it: a dashboard reading from another thread sees its
        round trip a call late, and no thread but the dispatcher's writes the holders' statistics."""
        pending = self._unsettled
        if pending is None or pending[1] != threading.get_ident():
            return  # settled by the thread that made the call (another one reading sees it a call late)
        self._unsettled = None
        self.lane.settle(self.verification.gate, pending[0])
        self._accounting.flush()

    def _lane_record(self, handle: Handle, answer: LaneAnswer, seconds: float, decoding: bool) -> tuple[LayerCall, bool]:
        address = self.pool.address_of
        return LayerCall(
            handle.layer, 1, answer.bytes_out, answer.bytes_in, handle.round_trips, seconds,
            {address(holder): rtt for holder, rtt, _ in answer.answered}, 1,
            worker_cpu={address(holder): cpu for holder, _, cpu in answer.answered if cpu is not None}, in_c=True,
        ), decoding

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Handle:
        """Plan and send layer `layer`'s rows. hidden [T, d], top_k_index [T, k] long, top_k_weights [T, k].

        The kernels' helper threads rest from here (qkernels.rest): the holders compute now, on
        cores they may share with this process, and `combine` waits for them."""
        started = time.perf_counter()
        qkernels.rest()
        if self._membership:
            self.settle()  # before holders are renumbered
            self.apply_membership()
        elif self.pool.gone and not self._flights and self.pool.prune_due():
            self.settle()
            self.pool.prune()
        self.pool.readmit(due_only=True)
        layer = LayerId(layer)
        fits = express.eligible(self.wire, self.fanout, self.verification.checker.policy.fraction, hidden)
        sent = self._lane(layer, hidden, top_k_index, top_k_weights) if fits else express.UNFIT
        self.settle()  # the last lane call's bookkeeping: after this one's send, while its holders compute
        if not isinstance(sent, LaneCall):
            shares = self.owners.plan(layer, top_k_index, top_k_weights)
            if sent == express.UNFIT and fits:
                sent = self._express(layer, hidden, top_k_index, top_k_weights, shares)
        self.call_number += 1
        if isinstance(sent, LaneCall):
            flight, pieces = sent, [(share.worker, 1) for share in sent.shares]
            self.wait.observe(started)  # how this call waits: dispatch/wait.py
        elif isinstance(sent, express.ExpressCall):
            flight, pieces = sent, [(one.worker, 1) for one in sent.sent]
        else:
            if sent == express.FAILED:  # a holder was taken down: plan again (probing it first)
                shares = self.owners.plan(layer, top_k_index, top_k_weights)
            flight = self._flight(layer, hidden, top_k_index, shares)
            pieces = flight.pieces
        self.routing.update(layer, top_k_index, top_k_weights)  # once sent: the holders compute meanwhile
        remote = [n for worker, n in pieces if worker not in self.pool.trusted]  # a local holder makes no trip
        round_trips = sum(remote) if self.fanout == "chain" else max(remote, default=0)  # a cut share's pieces go in turn
        self._flights.add(flight)
        return Handle(layer, hidden, top_k_index, flight, round_trips, started, self.call_number)

    def _flight(self, layer: LayerId, hidden: torch.Tensor, top_k_index: torch.Tensor, shares: list) -> Flight:
        flight = Flight(self.pool, self.verification, self.wire, layer, hidden, top_k_index)
        flight.start(shares, chain=self.fanout == "chain")
        if flight.error is not None:
            flight.abort()
        return flight

    def _lane(self, layer: LayerId, hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> LaneCall | str:
        """The call (express.eligible) sent in C (dispatch/lane.py), or why not: express.UNFIT (then
        express, else a flight) or express.FAILED (a holder was taken down: a flight)."""
        if self.owners.replicated(layer):
            return express.UNFIT
        return self.lane.send(self.wire, layer, hidden, top_k_index, top_k_weights, self.owners.of(layer))

    def _express(self, layer: LayerId, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 shares: list) -> express.ExpressCall | str:
        """The call (express.eligible) sent express (dispatch/express_call.py), or why not (express.UNFIT or
        FAILED): it goes as a flight. Its layer is planned: whether it has replicas is known."""
        if self.owners.replicated(layer):
            return express.UNFIT
        call = express.ExpressCall(layer, hidden, top_k_index, top_k_weights)
        requests = [share_request(self.wire, layer, hidden, top_k_index, share) for share in shares]
        sent = express.send(self.pool, call, shares, requests)
        return call if sent == express.SENT else sent

    def combine(self, handle: Handle) -> torch.Tensor:
        """Gather the replies and add them into [T, d] (the kernels rest while they come, as in `dispatch`)."""
        qkernels.rest()
        flight = handle.flight
        try:
            if isinstance(flight, LaneCall):
                got = self.lane.gather(self.verification.gate, flight, self.wait.spin_s(), self.wait.dozes)
                if isinstance(got, LaneAnswer):
                    return self._lane_answer(handle, got)
                flight = got  # the express call goes on (None: made again as a flight)
            answers, unchecked, bytes_out, bytes_in = self._gather(handle, flight)
        finally:
            self._flights.discard(handle.flight)
        for holder in unchecked:
            self.pool.ledger.used(holder, handle.call)
        out = self._combined(handle, answers)
        trusted = self.pool.trusted
        self._accounting.record(LayerCall(
            handle.layer, handle.hidden.shape[0], bytes_out, bytes_in, handle.round_trips,
            time.perf_counter() - handle.started,
            {self._address(holder): reply.seconds for _, reply, holder in answers},
            _rows(share.tokens for share, _, holder in answers if holder not in trusted and holder != REFEREE),
            worker_cpu={self._address(holder): reply.result.cpu_s for _, reply, holder in answers
                        if reply.result.cpu_s is not None},
        ))
        return out

    def _lane_answer(self, handle: Handle, answer: LaneAnswer) -> torch.Tensor:
        """A lane call's answer; its bookkeeping left for `settle`. The holders' use of it goes in the
        taint ledger now (a ban may come before the settling)."""
        for holder, _, _ in answer.answered:
            self.pool.ledger.used(holder, handle.call)  # a lane's holders are remote: never trusted
        self.settle()  # another lane call's, where calls of several groups are in flight
        self._unsettled = (answer, threading.get_ident())
        self._accounting.defer(functools.partial(self._lane_record, handle, answer, time.perf_counter() - handle.started,
                                                 self._accounting.decoding))  # recorded before any later call
        return answer.out

    def _gather(self, handle: Handle, flight: Flight | express.ExpressCall | None) -> tuple[list, set[int], int, int]:
        """The call's [(share, reply, holder)] in plan order, the holders whose answers in it no spot
        check confirmed, and its bytes out and in. flight None: a lane call that must be made again."""
        if isinstance(flight, express.ExpressCall):
            answers = express.gather(self.pool, self.verification.gate, flight)
            if answers is not None:
                unchecked = {holder for _, _, holder in answers if holder not in self.pool.trusted}
                return answers, unchecked, flight.bytes_out, flight.bytes_in
        if not isinstance(flight, Flight):  # given up: a flight
            shares = self.owners.plan(handle.layer, handle.top_k_index, handle.flight.top_k_weights)
            flight = self._flight(handle.layer, handle.hidden, handle.top_k_index, shares)
        flight.run(chain=self.fanout == "chain")
        return flight.answers(), flight.unchecked(), flight.bytes_out, flight.bytes_in

    def _combined(self, handle: Handle, answers: list) -> torch.Tensor:
        """The answers added into [T, d]: in exact mode as eager adds them, else summed."""
        if self.wire.mode != CombineMode.EXACT:
            return combine_partial(handle.hidden, [(share.tokens, reply.result.outputs) for share, reply, _ in answers])
        # [(tokens [T_w], [T_w, d])] of shares holding all their tokens' experts; the others' Results
        sums = [(share.tokens, reply.result.outputs) for share, reply, _ in answers
                if reply.result.mode == CombineMode.PARTIAL]
        exact = [reply.result for _, reply, _ in answers if reply.result.mode == CombineMode.EXACT]
        if handle.hidden.shape[0] == 1 and handle.hidden.dtype == torch.float32:
            out = combine_token(handle.hidden, sums, [(result.experts, result.outputs) for result in exact])
            if out is not None:
                return out
        per_expert = {}  # {e: [n_e, d]}
        for result in exact:
            for expert, block in zip(result.experts, torch.split(result.outputs, result.counts)):
                per_expert[expert] = block
        return combine_exact(handle.hidden, handle.top_k_index, per_expert, sums)

    def _address(self, worker: int) -> str:
        return LOCAL_ADDRESS if worker == REFEREE else self.pool.address_of(worker)

    # -- holders joining and leaving (dispatch/membership.py) -----------------------------

    def change_members(self, change: Change) -> None:
        """Queue a holder joining (a connected link, HELLO done) or leaving (its experts go to the
        other holders); thread-safe, applied between layer calls."""
        self._membership.put(change)

    def apply_membership(self) -> None:
        """Apply the queued joins and leaves, then rebuild the placement table over the members.

        Call only where no layer call is in flight: `dispatch` does at its start."""
        self.settle()
        paths = None
        for change in self._membership.take():
            if change.kind == JOIN:
                self.pool.admit(change.link)
                if change.path is not None:
                    paths = dict(self._accounting.paths) if paths is None else paths
                    paths[change.link.address] = change.path
            else:
                self.pool.retire(change.link, LEFT_CAUSE)
        if paths is not None:  # a new dict: another thread may be reading the old one
            self._accounting.paths = paths
        if not self._flights:
            self.pool.prune()
        self.pool.rebuild()

    def members(self) -> list[WorkerLink]:
        """The links of the holders that have not left (joins still queued are not counted)."""
        return self.pool.members()

    # -- holders' standing -----------------------------------------------------------------

    def take_taints(self) -> list[Taint]:
        """The bans since the last take, each with the layer calls that used the liar's unchecked
        answers (to roll back every sequence from its first such step)."""
        self.settle()
        return self.pool.take_taints()

    def readmit(self, due_only: bool = True) -> None:
        """Probe the down holders whose backoff has run out (all of them: due_only=False)."""
        self.settle()
        self.pool.readmit(due_only)

    def health(self, layers: Sequence[int], timeout_s: float) -> list[str]:
        """What stops a forward now ([] when ready): holders out of use whose experts nobody else
        serves, and those experts. Probes down holders that are due (and, when some experts have no
        usable holder, their holders at once), pings the others."""
        self.settle()
        self.pool.readmit(due_only=True)
        self.pool.ping_usable(timeout_s)
        gaps = self.pool.gaps(layers)
        if gaps:  # as in a layer call: when nobody else can serve, probe now, backoff or not
            self.pool.probe_holders(gaps)
            gaps = self.pool.gaps(layers)
        if not gaps:
            return []
        return self.pool.out_of_use() + [f"no usable worker holds {describe_gaps(gaps)}"]

    def standing(self) -> list[dict]:
        """Per holder: up, banned, degraded (losing hedges or missing deadlines), failures, cause,
        PING and round-trip quantiles (ms)."""
        self.settle()
        return self.pool.standing()

    def check_covers(self, layers: Sequence[int]) -> None:
        """Every expert of every MoE layer must have a holder."""
        gaps = missing(self.pool.table, layers)
        if gaps:
            raise MoeSwarmError(f"no worker holds {describe_gaps(gaps)}")

    def close(self) -> None:
        self.settle()
        if self._membership:
            self.apply_membership()  # links joined since the last layer call are closed too
        self.pool.close()


def _rows(tokens) -> int:
    """How many distinct rows of the step these [T_w] token index tensors cover."""
    tokens = [t.numpy() for t in tokens]
    if len(tokens) <= 1:
        return len(tokens[0]) if tokens else 0  # a share's tokens are distinct
    return len(np.unique(np.concatenate(tokens)))
