"""A decode step's layer call sent and gathered without a flight, where nothing in it can need one.

A `Flight` (dispatch/flight.py) is ready for everything a layer call may meet: shares cut to a
reply bound, hedged duplicates, spot checks, failover inside the call. Readiness costs Python on
every call (parts, attempts, the wait loop, verification's hooks), from caches a worker's
kernels sweep between calls (docs/measured.md, "express"). Most calls of a decode step meet none of it.

An express call is the same call for those: every share's DISPATCH (the same bytes a flight sends)
goes out at once, each reply is awaited in turn before the holder's deadline, checked as the
flight checks it (`result_problem`, then the plausibility gate for a holder not trusted), counted
in the holder's round trips and, unchecked, in the taint ledger; the dispatcher combines the
answers with the same function in the same order, so exact mode keeps its bits.

It is one of a layer call's paths (dispatch/paths.py), `ExpressPath`, asked after the lane and
before a flight. It takes one float32 token in exact mode over a lossless wire, star fan-out, no
spot checks drawn (fraction 0: `Call.one_token`), a layer none of whose experts has a second holder
(so no hedge and no per-call choice), and holders that are usable, not degraded, connected, with a
reply bound the answer fits. Whatever goes wrong (a send or a wait failing, a deadline missed, a
malformed or implausible answer) ends it: its other requests are forgotten, a failing holder is
taken down as a flight would, and the dispatcher makes the call again as a flight, which re-plans,
probes and settles as it always does.

Legend: d = hidden size, k = router top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moeswarm.dispatch.checks import result_problem
from moeswarm.dispatch.flight import share_request
from moeswarm.dispatch.owners import Owners
from moeswarm.dispatch.paths import Call, CallPath, Gathered, HandedOn, Handle, Outcome
from moeswarm.dispatch.plan import WorkerShare
from moeswarm.dispatch.plausible import NormGate
from moeswarm.dispatch.pool import HolderPool
from moeswarm.errors import WorkerError
from moeswarm.ids import LayerId, WorkerId
from moeswarm.transport.link import Pending, Reply
from moeswarm.transport.tcp import result_payload_bytes
from moeswarm.wire.messages import Dispatch


@dataclass(frozen=True)
class Sent:
    share: WorkerShare
    request: Dispatch
    worker: int
    pending: Pending
    deadline: float  # time.monotonic()


@dataclass(eq=False)
class ExpressCall:
    layer: LayerId
    hidden: torch.Tensor  # [1, d]
    top_k_index: torch.Tensor  # [1, k] long
    top_k_weights: torch.Tensor  # [1, k]
    sent: list[Sent] = field(default_factory=list)
    bytes_out: int = 0
    bytes_in: int = 0

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """(holder, DISPATCHes) per share: one each."""
        return [(one.worker, 1) for one in self.sent]


class ExpressPath:
    """The express path of a layer call (dispatch/paths.py `CallPath`)."""

    name, plans, defers = "express", True, False

    def __init__(self, pool: HolderPool, owners: Owners, gate: NormGate, flight: CallPath):
        self.pool = pool
        self.owners = owners
        self.gate = gate
        self.flight = flight  # the path a call given up on goes on as

    def eligible(self, call: Call) -> bool:
        return call.one_token()

    def send(self, call: Call) -> ExpressCall | Outcome:
        """`call` sent express, or why not; its layer is planned first (whether it has replicas is then known)."""
        shares = call.shares
        if self.owners.replicated(call.layer):
            return Outcome.UNFIT
        sent = ExpressCall(call.layer, call.hidden, call.top_k_index, call.top_k_weights)
        requests = [share_request(call.wire, call.layer, call.hidden, call.top_k_index, share) for share in shares]
        outcome = send(self.pool, sent, shares, requests)
        return sent if outcome is None else outcome

    def gather(self, handle: Handle, flight: ExpressCall) -> Gathered | HandedOn:
        answers = gather(self.pool, self.gate, flight)
        if answers is None:
            return HandedOn(self.flight, None)
        trusted = self.pool.trusted
        answered = [(holder, reply.seconds, reply.result.cpu_s) for _, reply, holder in answers]
        unchecked = {holder for _, _, holder in answers if holder not in trusted}
        return Gathered(answers, answered, unchecked, flight.bytes_out, flight.bytes_in)

    def record(self, answered: Gathered) -> None:
        """Nothing more: `gather` recorded each holder's round trip as its reply came."""


def send(pool: HolderPool, call: ExpressCall, shares: list[WorkerShare], requests: list[Dispatch]) -> Outcome | None:
    """Send every share's request (`requests`, in order): None; else nothing is left in flight:
    Outcome.UNFIT where a holder is unfit for an express call, Outcome.FAILED where a send failed
    (its holder is taken down: the call must be planned again)."""
    links, holders = pool.links, pool.holders
    for share in shares:
        holder, link = holders[share.worker], links[share.worker]
        if not holder.usable or holder.degraded or link.broken:
            return Outcome.UNFIT
    prepared = []
    for share, request in zip(shares, requests):
        bound = pool.reply_bound(share.worker)
        if bound is not None and result_payload_bytes(request) > bound:
            return Outcome.UNFIT
        prepared.append(links[share.worker].prepare(request))
    for share, request, ready in zip(shares, requests, prepared):
        try:
            pending = links[share.worker].send(ready)
        except WorkerError as error:
            give_up(pool, call, share.worker, error.cause)
            return Outcome.FAILED
        timeout = holders[share.worker].deadline_s(1)
        call.sent.append(Sent(share, request, share.worker, pending, time.monotonic() + timeout))
        call.bytes_out += pending.bytes_out
    return None


def gather(pool: HolderPool, gate: NormGate, call: ExpressCall) -> list[tuple[WorkerShare, Reply, int]] | None:
    """(share, reply, holder) per share in plan order, each checked; None where the call must be made
    again as a flight (nothing left in flight; a holder that erred taken down).

    Holders with nothing to select on (this process's experts: worker/local_link.py) compute when
    awaited: they are awaited first, while the others' replies are on the wire."""
    width = call.hidden.shape[1]
    order = sorted(range(len(call.sent)), key=lambda i: pool.links[call.sent[i].worker].fileno() is not None)
    answers: list = [None] * len(call.sent)
    for i in order:
        sent = call.sent[i]
        link, holder = pool.links[sent.worker], pool.holders[sent.worker]
        try:
            reply = link.wait(sent.pending, sent.deadline)
        except WorkerError as error:
            failed(pool, call, sent.worker, sent.deadline, error)
            return None
        call.bytes_in += reply.bytes_in
        problem = result_problem(sent.share, call.layer, sent.request.mode, width, reply.result, sent.request.hidden)
        if problem:
            give_up(pool, call, sent.worker, problem)
            return None
        if sent.worker not in pool.trusted and gate.problem(call.layer, reply.result.outputs, sent.request.hidden):
            give_up(pool, call, None, "")  # the flight asks again and settles who is right
            return None
        holder.round_trips.record(reply.seconds, 1)
        holder.on_time()
        answers[i] = (sent.share, reply, sent.worker)
    return answers


def failed(pool: HolderPool, call: ExpressCall, worker: int, deadline: float, error: WorkerError) -> None:
    """`worker`'s reply did not come (`error`; past its `deadline`: a miss): end `call`, take it down."""
    if time.monotonic() >= deadline:
        pool.stats.deadline_misses += 1
        pool.holders[worker].stalled(time.monotonic())
    give_up(pool, call, worker, error.cause)


def give_up(pool: HolderPool, call: ExpressCall, worker: int | None, cause: str) -> None:
    """End `call`: forget its requests (an answered one is forgotten already: a no-op) and take
    `worker` down for `cause` (None: nobody failed)."""
    for sent in call.sent:
        pool.links[sent.worker].forget(sent.pending)
    call.sent = []
    if worker is not None:
        pool.take_down(WorkerId(worker), cause)
