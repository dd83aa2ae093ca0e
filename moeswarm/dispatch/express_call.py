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

It is used (`eligible`, `send`) for one float32 token in exact mode over a lossless wire, star
fan-out, no spot checks drawn (fraction 0), a layer none of whose experts has a second holder (so
no hedge and no per-call choice), and holders that are usable, not degraded, connected, with a
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
from moeswarm.dispatch.plan import WorkerShare
from moeswarm.dispatch.plausible import NormGate
from moeswarm.dispatch.pool import HolderPool
from moeswarm.errors import WorkerError
from moeswarm.ids import LayerId, WorkerId
from moeswarm.transport.link import Pending, Reply
from moeswarm.transport.tcp import result_payload_bytes
from moeswarm.wire.config import CombineMode, WireConfig
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


def eligible(wire: WireConfig, fanout: str, spot_fraction: float, hidden: torch.Tensor) -> bool:
    """Whether a call of `hidden` [T, d] under these settings may go express (its holders aside)."""
    return (hidden.shape[0] == 1 and hidden.dtype == torch.float32 and fanout == "star" and spot_fraction == 0
            and wire.mode == CombineMode.EXACT and wire.dispatch_codec is None and wire.combine_codec is None)


SENT, UNFIT, FAILED = "sent", "unfit", "failed"


def send(pool: HolderPool, call: ExpressCall, shares: list[WorkerShare], requests: list[Dispatch]) -> str:
    """Send every share's request (`requests`, in order): SENT; else nothing is left in flight:
    UNFIT where a holder is unfit for an express call, FAILED where a send failed (its holder is
    taken down: the call must be planned again)."""
    links, holders = pool.links, pool.holders
    for share in shares:
        holder, link = holders[share.worker], links[share.worker]
        if not holder.usable or holder.degraded or link.broken:
            return UNFIT
    prepared = []
    for share, request in zip(shares, requests):
        bound = pool.reply_bound(share.worker)
        if bound is not None and result_payload_bytes(request) > bound:
            return UNFIT
        prepared.append(links[share.worker].prepare(request))
    for share, request, ready in zip(shares, requests, prepared):
        try:
            pending = links[share.worker].send(ready)
        except WorkerError as error:
            give_up(pool, call, share.worker, error.cause)
            return FAILED
        timeout = holders[share.worker].deadline_s(1)
        call.sent.append(Sent(share, request, share.worker, pending, time.monotonic() + timeout))
        call.bytes_out += pending.bytes_out
    return SENT


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
