"""One MoE layer call in flight: its shares, their attempts, and what happens when one goes wrong.

A `Part` is rows of the step for one holder (a share of the plan, or a piece of one after a
failover); an `Attempt` is a part sent to one holder. The loop waits for whichever reply comes
first and reacts:

- a good reply completes its part (a hedged twin still in flight is forgotten) and may draw a
  spot check: the same rows sent to another holder, compared when it answers;
- an error, a deadline missed, a dropped connection or a malformed RESULT takes the holder out of
  use (the dispatcher probes it again later) and re-plans its part over the other holders, within
  this call; when some experts have no usable holder left, `ExpertsUnavailable` names the
  holder, the layer and the experts;
- a reply later than the holder's p95, with a replica holding all the part's experts, sends a
  duplicate there: first good reply wins (identical in exact mode); a holder that keeps losing
  hedges or missing deadlines is degraded (dispatch/health.py) and planned around;
- an implausible reply (a row norm far above the layer's running statistics) is settled by a third
  computation and its holder banned when that computation is plausible (dispatch/verify.py).

Each expert's rows stay together whatever holder computes them, and `combine` adds experts in
ascending order: exact mode stays bit-identical through failover, hedging and checks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moeswarm.dispatch.checks import result_problem
from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.plan import WorkerShare, replan_share, share_experts
from moeswarm.dispatch.verify import CHECK, SERVE, Verification
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.ids import LayerId, WorkerId
from moeswarm.transport.fanout import readable, ready, send
from moeswarm.transport.link import Pending, Reply
from moeswarm.wire.messages import Dispatch

if TYPE_CHECKING:
    from moeswarm.dispatch.dispatcher import Dispatcher

@dataclass(eq=False)
class Part:
    share: WorkerShare
    request: Dispatch
    role: str = SERVE
    checks: "Part | None" = None  # role CHECK: the served part whose answer this recomputes
    tried: set[int] = field(default_factory=set)  # holders sent this part
    reply: Reply | None = None
    winner: int | None = None
    replaced: bool = False  # its rows were handed to other parts
    verifiers: list["Part"] = field(default_factory=list)  # role SERVE: open spot-check parts
    confirmed: bool = False  # role SERVE: a spot check computed the same answer

    @property
    def done(self) -> bool:
        return self.reply is not None or self.replaced


@dataclass(eq=False)
class Attempt:
    part: Part
    worker: int
    pending: Pending
    deadline: float  # time.monotonic()
    timeout_s: float  # the deadline's distance from the send, for the message
    hedge_at: float | None  # time.monotonic(); None: not hedged
    hedge: bool = False  # this attempt is itself a hedged duplicate
    hedged: bool = False  # a duplicate of it was sent


class Flight(Verification):
    def __init__(self, dispatcher: "Dispatcher", layer: LayerId, hidden: torch.Tensor, top_k_index: torch.Tensor):
        self.d = dispatcher
        self.layer = layer
        self.hidden = hidden  # [T, d]
        self.top_k_index = top_k_index  # [T, k]
        self.parts: list[Part] = []
        self.open: list[Attempt] = []
        self.queued: deque[tuple[Part, int, object]] = deque()  # chain fan-out: parts not sent yet
        self.bytes_out = self.bytes_in = 0
        self.error: WorkerError | None = None
        self.probed: set[int] = set()  # holders probed as a last resort in this call

    # -- sending ---------------------------------------------------------------------------

    def start(self, shares: list[WorkerShare], chain: bool) -> None:
        """Encode every share first (a codec that refuses its input sends nothing), then send."""
        for share in shares:
            ready_or_down(self.d, share.worker)
        parts = [Part(share, self.d.request(self.layer, self.hidden, share)) for share in shares]
        prepared = [(part, part.share.worker, self.d.links[part.share.worker].prepare(part.request)) for part in parts]
        self.parts += parts
        self.queued.extend(prepared)
        self._send_queued(chain)

    def _send_queued(self, chain: bool) -> None:
        while self.queued and not (chain and self.open):
            part, worker, prepared = self.queued.popleft()
            self._send(part, worker, prepared)

    def _send(self, part: Part, worker: int, prepared: object | None = None, hedge: bool = False) -> None:
        link, holder = self.d.links[worker], self.d.holders[worker]
        part.tried.add(worker)
        try:
            if not holder.usable:
                raise WorkerError(link.address, holder.cause or "not in use")
            pending = link.send(prepared) if prepared is not None else send(self.d.links, worker, part.request).pending
        except WorkerError as error:
            self._holder_failed(worker, error.cause)
            if not part.done and not self._attempts_of(part):
                self._lost(part, worker, error.cause)
            return
        rows = part.share.tokens.numel()
        now = time.monotonic()
        hedge_after = None if hedge or part.role != SERVE else holder.hedge_after_s(rows)
        early = not holder.measured and self.d.replica_for(self.layer, share_experts(part.share), {worker}) is not None
        timeout = holder.deadline_s(rows, early)
        self.open.append(Attempt(part, worker, pending, now + timeout, timeout,
                                 None if hedge_after is None else now + hedge_after, hedge))
        self.bytes_out += pending.bytes_out

    # -- the loop --------------------------------------------------------------------------

    def run(self, chain: bool) -> None:
        """Until every part is answered (and checked); ExpertsUnavailable when some cannot be."""
        while self.error is None and (self.open or self.queued):
            self._send_queued(chain)
            answered = [a for a in self.open if self.d.links[a.worker].has_reply(a.pending)]
            for attempt in answered:
                if attempt in self.open:
                    self._collect(attempt)
            if answered:
                continue
            now = time.monotonic()
            for attempt in [a for a in self.open if a.deadline <= now]:
                if attempt in self.open:
                    self.d.stats.deadline_misses += 1
                    self.d.holders[attempt.worker].stalled(now)
                    self._holder_failed(attempt.worker, f"no reply within its deadline of {attempt.timeout_s:.3g} s "
                                                        "(worker stalled or overloaded?)")
            for attempt in [a for a in self.open if a.hedge_at is not None and a.hedge_at <= now]:
                attempt.hedge_at, attempt.hedged = None, True
                self._hedge(attempt.part, attempt.worker)
            if self.error is not None or not self.open:
                continue
            wake = min([a.deadline for a in self.open] + [a.hedge_at for a in self.open if a.hedge_at is not None])
            for worker in readable(self.d.links, {a.worker for a in self.open}, wake - time.monotonic()):
                mine = [a for a in self.open if a.worker == worker]
                if not mine:
                    continue
                try:
                    self.d.links[worker].pump(max(a.deadline for a in mine))
                except WorkerError as error:
                    self._holder_failed(worker, error.cause)
        if self.error is not None:
            self.abort()

    def abort(self) -> None:
        """Give up on everything in flight (each link drops the replies when they come) and raise."""
        for attempt in self.open:
            self.d.links[attempt.worker].forget(attempt.pending)
        self.open.clear()
        self.queued.clear()
        raise self.error

    def _collect(self, attempt: Attempt) -> None:
        link, part = self.d.links[attempt.worker], attempt.part
        self.open.remove(attempt)
        try:
            reply = link.wait(attempt.pending, attempt.deadline)
        except WorkerError as error:
            self._holder_failed(attempt.worker, error.cause, [attempt])
            return
        self.bytes_in += reply.bytes_in
        if part.done:  # a hedged twin answered first; this reply is surplus
            return
        problem = result_problem(part.share, self.layer, part.request.mode, self.hidden.shape[1], reply.result,
                                 part.request.hidden)
        if problem:
            self._holder_failed(attempt.worker, problem, [attempt])
            return
        self.d.holders[attempt.worker].round_trips.record(reply.seconds, part.share.tokens.numel())
        part.reply, part.winner = reply, attempt.worker
        self.d.stats.hedge_wins += attempt.hedge
        for twin in self._attempts_of(part):
            self.open.remove(twin)
            self.d.links[twin.worker].forget(twin.pending)
            if attempt.hedge and not twin.hedge:  # the hedge won: the holder it stood in for lost one
                self.d.holders[twin.worker].strike(time.monotonic())
        if not attempt.hedge and not attempt.hedged:  # answered in time, before any duplicate
            self.d.holders[attempt.worker].on_time()
        implausible = part.role == SERVE and attempt.worker not in self.d.trusted and self.d.gate.problem(self.layer, reply.result.outputs, part.request.hidden)
        if implausible:  # (a check's answer is compared instead: a difference is settled the same way)
            self._implausible(part, attempt.worker, implausible)
            return
        if part.role == SERVE and attempt.worker not in self.d.trusted and self.d.checker.draw():
            self._spot_check(part)
        elif part.role == CHECK:
            checked = part.checks
            if checked.reply is None or checked.replaced:  # its answer was already thrown out
                checked.verifiers, part.replaced = [], True
            else:
                self._verify(checked)

    # -- failures --------------------------------------------------------------------------

    def _holder_failed(self, worker: int, cause: str, already_removed: list[Attempt] = ()) -> None:
        """`worker` erred: out of use (its link closed); each of its open parts goes elsewhere."""
        self.d.take_down(WorkerId(worker), cause)
        lost = list(already_removed) + [a for a in self.open if a.worker == worker]
        for attempt in lost:
            if attempt in self.open:
                self.open.remove(attempt)
        for attempt in lost:
            part = attempt.part
            if not part.done and not self._attempts_of(part):
                self._lost(part, worker, cause)

    def _lost(self, part: Part, worker: int, cause: str) -> None:
        """`part` has no attempt left and no answer: re-plan it (a check is dropped instead)."""
        if self.error is not None:
            return
        if part.role == CHECK:
            self._drop_check(part.checks)
            return
        experts = share_experts(part.share)
        owner = self.d.choose(self.layer, experts)
        lacking = [e for e in experts if owner[e] < 0]
        if lacking:  # a last resort before failing the call: probe their holders now, backoff or not
            for holder in sorted({w for e in lacking for w in self.d.table.holders(self.layer, e)} - self.probed):
                self.probed.add(holder)  # once per call: a holder that fails again is not probed in a loop
                if not self.d.holders[holder].usable:
                    self.d.probe(holder)
            owner = self.d.choose(self.layer, experts)
            lacking = [e for e in experts if owner[e] < 0]
        if lacking:
            self.error = ExpertsUnavailable(self.d.links[worker].address, cause, self.layer, lacking)
            return
        part.replaced = True
        self.d.stats.failovers += 1
        for share in replan_share(part.share, owner):
            piece = Part(share, self.d.request(self.layer, self.hidden, share), tried=set(part.tried))
            self.parts.append(piece)
            self._send(piece, share.worker)

    def _attempts_of(self, part: Part) -> list[Attempt]:
        return [a for a in self.open if a.part is part]

    # -- hedging ---------------------------------------------------------------------------

    def _hedge(self, part: Part, worker: int) -> None:
        if part.done:
            return
        target = self.d.replica_for(self.layer, share_experts(part.share), exclude=part.tried | {worker})
        if target is None:
            return
        self.d.stats.hedges += 1
        try:
            ready(self.d.links[target], self.d.policy.probe_timeout_s)
        except WorkerError as error:
            self.d.take_down(WorkerId(target), error.cause)
            return
        self._send(part, target, hedge=True)

    # -- results ---------------------------------------------------------------------------

    def answers(self) -> list[tuple[WorkerShare, Reply, int]]:
        """(share, reply, holder) of every part that counts, in the order they were planned."""
        return [(p.share, p.reply, p.winner) for p in self.parts
                if p.role == SERVE and p.reply is not None and not p.replaced]

    def unchecked(self) -> set[int]:
        """The holders (not trusted) whose answers count in this call without a spot check confirming them."""
        return {p.winner for p in self.parts if p.role == SERVE and p.reply is not None and not p.replaced
                and not p.confirmed and p.winner not in self.d.trusted and p.winner >= 0}


def ready_or_down(dispatcher: "Dispatcher", worker: int) -> None:
    """Reconnect a usable holder's broken link before use; a failure takes it down."""
    holder = dispatcher.holders[worker]
    try:
        ready(dispatcher.links[worker], dispatcher.policy.probe_timeout_s)
        if holder.ping_s is None and worker not in dispatcher.trusted and holder.usable:
            holder.ping_s = dispatcher.links[worker].ping(dispatcher.policy.probe_timeout_s)  # its first deadline
    except (WorkerError, MoeSwarmError, OSError) as error:
        dispatcher.take_down(WorkerId(worker), getattr(error, "cause", str(error)))
