"""The dispatcher: one MoE layer's rows out to their holders, the outputs back, combined.

plan -> send -> gather -> combine. `dispatch` plans the layer (who gets which rows), sends
every share and returns a handle at once; `combine` gathers the replies (failing over, hedging
and spot-checking as dispatch/flight.py describes), checks them and adds them up. Between the
two the caller may compute local work (shared experts): the pair is joined by the handle, as in
DeepEP. A call goes one of three paths (dispatch/paths.py: the lane in C, express, a flight),
chosen in one place (`_send`); a decode step's call that can meet none of a flight's cases goes in
C or express, without the flight's bookkeeping, and is made again as a flight when anything goes wrong.

Its collaborators, each held and called, none reaching into another:
- the holder pool (dispatch/pool.py): links, standing, the placement table; choose, probe, take
  down, ban; members joining and leaving (queued from any thread through `change_members`,
  applied between layer calls; tombstones pruned after `prune_after_s`, renumbering holders);
- the owners (dispatch/owners.py): the plan of a call over the usable holders;
- verification (dispatch/verify.py): spot checks, plausibility, who lied;
- the paths (dispatch/paths.py): each keeps what it sent of a call (a `Flight`, an `ExpressCall`,
  a `LaneCall`) between `dispatch` and `combine`;
- the books (dispatch/books.py): every call's bookkeeping, whatever path it took.

Layer calls are numbered (`call_number`, monotonic). The answers each call used without a spot
check confirming them are kept per holder (dispatch/taint.py); when a holder is banned, the calls
that used its unchecked answers become a `Taint` (`take_taints`), for the engine to roll back.

Legend: T = tokens in the step, k = router top-k, d = hidden size, E = routed experts.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch

from moeswarm.dispatch.accounting import Accounting, Resilience
from moeswarm.dispatch.books import Books
from moeswarm.dispatch.combine import combine_exact, combine_partial, combine_token
from moeswarm.dispatch.express_call import ExpressPath
from moeswarm.dispatch.flight import FlightPath
from moeswarm.dispatch.health import REPLY_TIMEOUT_S, DeadlinePolicy
from moeswarm.dispatch.lane import LanePath
from moeswarm.dispatch.membership import JOIN, LEFT_CAUSE, Change, MembershipQueue
from moeswarm.dispatch.owners import Owners
from moeswarm.dispatch.paths import Call, CallPath, HandedOn, Handle, InFlight, Outcome
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
from moeswarm.kernels import qkernels
from moeswarm.wire.config import EXACT, CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch, Result

__all__ = ["PRUNE_AT", "REPLY_TIMEOUT_S", "Dispatcher", "Handle"]


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
        self.wait = WaitPolicy()  # whether a lane call spins for its replies (dispatch/wait.py)
        self.verification = Verification(self.pool, SpotChecker(spot_checks or SpotCheckPolicy()), self.stats, referee)
        self.books = Books(self.pool, Accounting(paths=dict(paths or {})))  # every call's bookkeeping
        # a layer call's paths, asked in this order (dispatch/paths.py): the first to send a call takes it
        flight = FlightPath(self.pool, self.verification, self.owners, chain=fanout == "chain")
        express = ExpressPath(self.pool, self.owners, self.verification.gate, flight)
        self.lane = LanePath(self.pool, self.owners, self.verification.gate, self.wait, express, flight)
        self.call_paths: tuple[CallPath, ...] = (self.lane, express, flight)
        self.routing = routing or RoutingStats(table.num_experts)  # live routing counts
        self.call_number = 0  # layer calls started so far
        self._membership = MembershipQueue()
        self._flights: weakref.WeakSet = weakref.WeakSet()  # dispatched, not yet combined (or dropped)

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
        """The holders' standing (every call's bookkeeping made: `settle`)."""
        self.settle()
        return self.pool.holders

    @property
    def accounting(self) -> Accounting:
        """The layer calls so far and the traffic they made (every call's bookkeeping made: `settle`)."""
        self.settle()
        return self.books.accounting

    def settle(self) -> None:
        """Make the bookkeeping a lane call left for later (dispatch/books.py): everything that reads or
        changes the holders' standing settles first."""
        self.books.settle()

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
        call = Call(layer, hidden, top_k_index, top_k_weights, self.wire, self.fanout,
                    self.verification.checker.policy.fraction, started,
                    functools.partial(self.owners.plan, layer, top_k_index, top_k_weights))
        path, flight = self._send(call)
        self.call_number += 1
        self.routing.update(layer, top_k_index, top_k_weights)  # once sent: the holders compute meanwhile
        remote = [n for worker, n in flight.pieces if worker not in self.pool.trusted]  # a local holder makes no trip
        round_trips = sum(remote) if self.fanout == "chain" else max(remote, default=0)  # a cut share's pieces go in turn
        self._flights.add(flight)
        return Handle(layer, hidden, top_k_index, flight, round_trips, started, self.call_number, path, top_k_weights,
                      call.wire)

    def _send(self, call: Call) -> tuple[CallPath, InFlight]:
        """The one place a layer call's path is chosen: each path in turn (`call_paths`), the first eligible
        one that sends the call takes it; a path that says `Outcome.UNFIT` passes it on. The last bookkeeping
        left for later is made before the call is planned, else once it is sent (while its holders compute)."""
        for path in self.call_paths:
            if path.plans:
                self.settle()  # the plan sees every earlier call's round trips
            if not path.eligible(call):
                continue
            sent = path.send(call)
            if sent is Outcome.FAILED:
                break
            if sent is not Outcome.UNFIT:
                self.settle()
                return path, sent
        # a send failed and its holder was taken down: plan again (probing it first), as a flight
        call.replan()
        self.settle()
        flight = self.call_paths[-1]
        return flight, flight.send(call)

    def combine(self, handle: Handle) -> torch.Tensor:
        """Gather the replies and add them into [T, d] (the kernels rest while they come, as in `dispatch`)."""
        qkernels.rest()
        try:
            got = handle.path.gather(handle, handle.flight)
            while type(got) is HandedOn:  # another path goes on with the call
                got = got.path.gather(handle, got.flight)
        finally:
            self._flights.discard(handle.flight)
        out = got.out if got.out is not None else self._combined(handle, got.answers)
        self.books.record(handle, got)
        return out

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
                    paths = dict(self.books.accounting.paths) if paths is None else paths
                    paths[change.link.address] = change.path
            else:
                self.pool.retire(change.link, LEFT_CAUSE)
        if paths is not None:  # a new dict: another thread may be reading the old one
            self.books.accounting.paths = paths
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

