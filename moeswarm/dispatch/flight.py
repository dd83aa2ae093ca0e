"""One MoE layer call in flight: its parts, their attempts, and what happens when one goes wrong.

Parts and attempts are dispatch/parts.py's. The loop waits for whichever reply comes first and
reacts:

- a share whose RESULT would be over its holder's reply bound goes as pieces, each sent when the
  one before it is answered (dispatch/chunks.py; exact mode cuts between experts, so the sum stays
  bit-identical);
- a good reply completes its part (a hedged twin still in flight is forgotten) and goes to
  verification (dispatch/verify.py): the plausibility gate, maybe a spot check (the same rows
  sent to another holder, compared when it answers);
- an error, a deadline missed, a dropped connection or a malformed RESULT takes the holder out of
  use (the pool probes it again later) and re-plans its part over the other holders, within this
  call; when some experts have no usable holder left, `ExpertsUnavailable` names the holder, the
  layer and the experts;
- a reply later than the holder's p95, with a replica holding all the part's experts, sends a
  duplicate there: first good reply wins (identical in exact mode); a holder that keeps losing
  hedges or missing deadlines is degraded (dispatch/health.py) and planned around.

A flight is a layer call's last path (dispatch/paths.py, `FlightPath`): every call may go this way,
and a call the lane or express gives up on is made again as one. The flight acts on holders only
through the pool (dispatch/pool.py) and implements the `FlightOps` that verification acts through.
Each expert's rows stay together whatever holder computes them, and `combine` adds experts in
ascending order: exact mode stays bit-identical through failover, hedging and checks.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from moeswarm.dispatch.checks import expected_rows, result_problem
from moeswarm.dispatch.chunks import ReplyTooLarge, cut_share
from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.owners import Owners
from moeswarm.dispatch.parts import CHECK, SERVE, Attempt, Part
from moeswarm.dispatch.paths import Call, Gathered, Handle
from moeswarm.dispatch.plan import WorkerShare, replan_share, share_experts
from moeswarm.dispatch.pool import HolderPool
from moeswarm.dispatch.verify import Verification
from moeswarm.errors import WorkerError
from moeswarm.ids import LayerId, WorkerId
from moeswarm.transport.fanout import readable, send
from moeswarm.transport.link import Reply
from moeswarm.wire.codecs import lossless_codec
from moeswarm.wire.config import CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch


class FlightPath:
    """The flight path of a layer call (dispatch/paths.py `CallPath`): every call is eligible."""

    name, plans, defers = "flight", True, False

    def __init__(self, pool: HolderPool, verification: Verification, owners: Owners, chain: bool):
        self.pool = pool
        self.verification = verification
        self.owners = owners
        self.chain = chain  # chain fan-out: one share at a time

    def eligible(self, call: Call) -> bool:
        return True

    def send(self, call: Call) -> Flight:
        """`call` sent as a flight (its error raised where a share cannot be sent at all)."""
        return self._started(call.wire, call.layer, call.hidden, call.top_k_index, call.shares)

    def gather(self, handle: Handle, flight: Flight | None) -> Gathered:
        """Every part answered (and checked); flight None: a call another path gave up on, made
        again as a flight from a new plan."""
        if flight is None:
            shares = self.owners.plan(handle.layer, handle.top_k_index, handle.top_k_weights)
            flight = self._started(handle.wire, handle.layer, handle.hidden, handle.top_k_index, shares)
        flight.run(chain=self.chain)
        answers = flight.answers()
        return Gathered(answers, [(holder, reply.seconds, reply.result.cpu_s) for _, reply, holder in answers],
                        flight.unchecked(), flight.bytes_out, flight.bytes_in)

    def record(self, answered: Gathered) -> None:
        """Nothing more: the flight recorded each holder's round trip as its reply came."""

    def _started(self, wire: WireConfig, layer: LayerId, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 shares: list[WorkerShare]) -> Flight:
        flight = Flight(self.pool, self.verification, wire, layer, hidden, top_k_index)
        flight.start(shares, chain=self.chain)
        if flight.error is not None:
            flight.abort()
        return flight


class Flight:
    def __init__(self, pool: HolderPool, verification: Verification, wire: WireConfig, layer: LayerId,
                 hidden: torch.Tensor, top_k_index: torch.Tensor):
        self.pool = pool
        self.verification = verification
        self.wire = wire
        self.layer = layer
        self.hidden = hidden  # [T, d]
        self.top_k_index = top_k_index  # [T, k]
        self.parts: list[Part] = []
        self.open: list[Attempt] = []
        self.queued: deque[tuple[Part, int, object]] = deque()  # chain fan-out: parts not sent yet
        self.bytes_out = self.bytes_in = 0
        self.error: WorkerError | None = None
        self.probed: set[int] = set()  # holders probed as a last resort in this call
        self.pieces: list[tuple[int, int]] = []  # (holder, DISPATCHes) per planned share: more than 1 when cut

    def request(self, share: WorkerShare) -> Dispatch:
        return share_request(self.wire, self.layer, self.hidden, self.top_k_index, share)

    # -- sending ---------------------------------------------------------------------------

    def start(self, shares: list[WorkerShare], chain: bool) -> None:
        """Encode every share first (a codec that refuses its input sends nothing), then send.

        A share whose RESULT would be over its holder's reply bound goes as pieces, one after
        another (dispatch/chunks.py); `self.pieces` counts them per share, in plan order."""
        for share in shares:
            self.pool.ready(share.worker)
        parts = self._parts(shares)
        if self.error is not None:
            return
        for part in parts:  # a share's pieces are consecutive; its first comes after none
            if part.after is None:
                self.pieces.append((part.share.worker, 0))
            worker, count = self.pieces[-1]
            self.pieces[-1] = (worker, count + 1)
        prepared = [(part, part.share.worker, self.pool.links[part.share.worker].prepare(part.request)) for part in parts]
        self.parts += parts
        self.queued.extend(prepared)
        self._send_queued(chain)

    def _parts(self, shares: list[WorkerShare], tried: set[int] = frozenset()) -> list[Part]:
        """A part per share, or per piece of a share cut to its holder's reply bound (each piece after
        the one before it); [] with `self.error` set when a share cannot be cut exactly."""
        combine = self.wire.combine_codec or lossless_codec(self.hidden.dtype)
        parts = []
        for share in shares:
            bound = self.pool.reply_bound(share.worker)
            try:
                pieces = cut_share(share, self.wire.mode, self.hidden.shape[1], combine, self.pool.table.num_experts, bound)
            except ReplyTooLarge as error:
                self.error = WorkerError(self.pool.address_of(share.worker),
                                         f"layer {self.layer}: {error}, over the {bound} bytes it sends at once "
                                         "(worker flag --max-unsent-bytes)")
                return []
            before = None
            for piece in pieces:
                before = Part(piece, self.request(piece), tried=set(tried), after=before)
                parts.append(before)
        return parts

    def _send_queued(self, chain: bool) -> None:
        held = []  # pieces whose piece before is still on its way: a worker holds one such RESULT at a time
        while self.queued and not (chain and self.open):
            part, worker, prepared = self.queued.popleft()
            if part.after is not None and not part.after.done:
                held.append((part, worker, prepared))
                continue
            self.send(part, worker, prepared)
        self.queued.extendleft(reversed(held))

    def send(self, part: Part, worker: int, prepared: object | None = None, hedge: bool = False) -> None:
        """Send `part` to `worker` (prepared: its encoded request, if it was); a failure fails the holder."""
        link, holder = self.pool.links[worker], self.pool.holders[worker]
        part.tried.add(worker)
        try:
            if not holder.usable:
                raise WorkerError(link.address, holder.cause or "not in use")
            pending = link.send(prepared) if prepared is not None else send(self.pool.links, worker, part.request).pending
        except WorkerError as error:
            self.holder_failed(worker, error.cause)
            if not part.done and not self.in_flight(part):
                self.lost(part, worker, error.cause)
            return
        rows = part.share.tokens.numel()
        now = time.monotonic()
        hedge_after = None if hedge or part.role != SERVE else holder.hedge_after_s(rows)
        early = not holder.measured and self.pool.replica_for(self.layer, share_experts(part.share), {worker}) is not None
        timeout = holder.deadline_s(rows, early)
        self.open.append(Attempt(part, worker, pending, now + timeout, timeout,
                                 None if hedge_after is None else now + hedge_after, hedge))
        self.bytes_out += pending.bytes_out
        if part.expected is None and part.request.mode == CombineMode.EXACT:
            part.expected = expected_rows(part.share)  # while the holder computes, not once it has answered

    # -- the loop --------------------------------------------------------------------------

    def run(self, chain: bool) -> None:
        """Until every part is answered (and checked); ExpertsUnavailable when some cannot be."""
        links, holders = self.pool.links, self.pool.holders
        while self.error is None and (self.open or self.queued):
            self._send_queued(chain)
            answered = [a for a in self.open if links[a.worker].has_reply(a.pending)]
            for attempt in answered:
                if attempt in self.open:
                    self._collect(attempt)
            if answered:
                continue
            now = time.monotonic()
            for attempt in [a for a in self.open if a.deadline <= now]:
                if attempt in self.open:
                    self.pool.stats.deadline_misses += 1
                    holders[attempt.worker].stalled(now)
                    self.holder_failed(attempt.worker, f"no reply within its deadline of {attempt.timeout_s:.3g} s "
                                                       "(worker stalled or overloaded?)")
            for attempt in [a for a in self.open if a.hedge_at is not None and a.hedge_at <= now]:
                attempt.hedge_at, attempt.hedged = None, True
                self._hedge(attempt.part, attempt.worker)
            if self.error is not None or not self.open:
                continue
            wake = min([a.deadline for a in self.open] + [a.hedge_at for a in self.open if a.hedge_at is not None])
            for worker in readable(links, {a.worker for a in self.open}, wake - time.monotonic()):
                mine = [a for a in self.open if a.worker == worker]
                if not mine:
                    continue
                try:
                    links[worker].pump(max(a.deadline for a in mine))
                except WorkerError as error:
                    self.holder_failed(worker, error.cause)
        if self.error is not None:
            self.abort()

    def abort(self) -> None:
        """Give up on everything in flight (each link drops the replies when they come) and raise."""
        for attempt in self.open:
            self.pool.links[attempt.worker].forget(attempt.pending)
        self.open.clear()
        self.queued.clear()
        raise self.error

    def _collect(self, attempt: Attempt) -> None:
        pool, part = self.pool, attempt.part
        self.open.remove(attempt)
        try:
            reply = pool.links[attempt.worker].wait(attempt.pending, attempt.deadline)
        except WorkerError as error:
            self.holder_failed(attempt.worker, error.cause, [attempt])
            return
        self.bytes_in += reply.bytes_in
        if part.done:  # a hedged twin answered first; this reply is surplus
            return
        problem = result_problem(part.share, self.layer, part.request.mode, self.hidden.shape[1], reply.result,
                                 part.request.hidden, part.expected)
        if problem:
            self.holder_failed(attempt.worker, problem, [attempt])
            return
        pool.holders[attempt.worker].round_trips.record(reply.seconds, part.share.tokens.numel())
        part.reply, part.winner = reply, attempt.worker
        pool.stats.hedge_wins += attempt.hedge
        for twin in self._attempts_of(part):
            self.open.remove(twin)
            pool.links[twin.worker].forget(twin.pending)
            if attempt.hedge and not twin.hedge:  # the hedge won: the holder it stood in for lost one
                pool.holders[twin.worker].strike(time.monotonic())
        if not attempt.hedge and not attempt.hedged:  # answered in time, before any duplicate
            pool.holders[attempt.worker].on_time()
        self.verification.answered(self, part, attempt.worker)

    # -- failures --------------------------------------------------------------------------

    def holder_failed(self, worker: int, cause: str, already_removed: list[Attempt] = ()) -> None:
        """`worker` erred: out of use (its link closed); each of its open parts goes elsewhere."""
        self.pool.take_down(WorkerId(worker), cause)
        lost = list(already_removed) + [a for a in self.open if a.worker == worker]
        for attempt in lost:
            if attempt in self.open:
                self.open.remove(attempt)
        for attempt in lost:
            part = attempt.part
            if not part.done and not self.in_flight(part):
                self.lost(part, worker, cause)

    def lost(self, part: Part, worker: int, cause: str) -> None:
        """`part` has no attempt left and no answer: re-plan it (a check is dropped instead)."""
        if self.error is not None:
            return
        if part.role == CHECK:
            self.verification.drop_checks(self, part.checks)
            return
        experts = share_experts(part.share)
        owner = self.pool.choose(self.layer, experts)
        lacking = [e for e in experts if owner[e] < 0]
        if lacking:  # a last resort before failing the call: probe their holders now, backoff or not
            self.pool.probe_holders({self.layer: lacking}, self.probed)
            owner = self.pool.choose(self.layer, experts)
            lacking = [e for e in experts if owner[e] < 0]
        if lacking:
            self.error = ExpertsUnavailable(self.pool.address_of(worker), cause, self.layer, lacking)
            return
        pieces = self._parts(replan_share(part.share, owner), part.tried)
        if self.error is not None:
            return
        part.replaced = True
        self.pool.stats.failovers += 1
        for piece in pieces:
            self.parts.append(piece)
            if piece.after is None:
                self.send(piece, piece.share.worker)
            else:
                self.queued.append((piece, piece.share.worker, None))

    def cancel(self, part: Part) -> None:
        """Forget `part`'s open attempts (their replies are dropped when they come)."""
        for attempt in self._attempts_of(part):
            self.open.remove(attempt)
            self.pool.links[attempt.worker].forget(attempt.pending)

    def in_flight(self, part: Part) -> bool:
        return any(a.part is part for a in self.open)

    def _attempts_of(self, part: Part) -> list[Attempt]:
        return [a for a in self.open if a.part is part]

    # -- hedging ---------------------------------------------------------------------------

    def _hedge(self, part: Part, worker: int) -> None:
        if part.done:
            return
        target = self.pool.replica_for(self.layer, share_experts(part.share), exclude=part.tried | {worker})
        if target is None:
            return
        self.pool.stats.hedges += 1
        if self.pool.ready(target, first_ping=False):
            self.send(part, target, hedge=True)

    # -- results ---------------------------------------------------------------------------

    def answers(self) -> list[tuple[WorkerShare, Reply, int]]:
        """(share, reply, holder) of every part that counts, in the order they were planned."""
        return [(p.share, p.reply, p.winner) for p in self.parts if p.counts]

    def unchecked(self) -> set[int]:
        """The holders (not trusted) whose answers count in this call without a spot check confirming them."""
        return {p.winner for p in self.parts
                if p.counts and not p.confirmed and p.winner not in self.pool.trusted and p.winner >= 0}


def share_request(wire: WireConfig, layer: LayerId, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  share: WorkerShare) -> Dispatch:
    """The DISPATCH of `share`'s rows: hidden [T_w, d] and its routing, in this call's wire.

    In exact mode a share whose experts come first in each of its tokens (every other expert of
    the token has a higher id; a share holding all of them too) asks for their sums (partial
    mode): its holder adds each token's expert rows in ascending expert order from zero, the
    first adds `combine_exact` makes here, which then goes on from that sum with the other
    holders' rows. The bits are the same and the RESULT is smaller (one row per token, not one
    per expert): with experts split in ranges, the holder of the lowest range sums every time."""
    lossless = lossless_codec(hidden.dtype)
    mode = CombineMode.PARTIAL if wire.mode == CombineMode.EXACT and _first(wire, hidden, top_k_index, share) else wire.mode
    whole = share.tokens.shape[0] == hidden.shape[0]  # distinct, ascending tokens: all of them, no gather
    rows = hidden if whole else hidden[share.tokens]  # [T_w, d]
    return Dispatch(layer, rows, share.top_k_index, share.top_k_weights,
                    mode, wire.dispatch_codec or lossless, wire.combine_codec or lossless,
                    wire.timings)


def _first(wire: WireConfig, hidden: torch.Tensor, top_k_index: torch.Tensor, share: WorkerShare) -> bool:
    """Whether, for each token of `share`, its experts come before the token's other routed experts
    (all of them, where it holds them all); float32 over a lossless combine codec only."""
    if hidden.dtype != torch.float32 or wire.combine_codec is not None:
        return False
    if share.top_k_index is top_k_index:  # the call's whole routing (one holder)
        return True
    if share.tokens.shape[0] == 1:  # a decode step's token: plain Python (numpy's calls cost more here)
        mine_row, routed_row = share.top_k_index.tolist()[0], top_k_index[share.tokens[0]].tolist()
        others_row = [e for e, m in zip(routed_row, mine_row) if e >= 0 and m < 0]
        return not others_row or max(mine_row) < min(others_row)
    mine = share.top_k_index.numpy()  # [T_w, k]: -1 where another holder has the slot
    routed = top_k_index.numpy()[share.tokens.numpy()]  # [T_w, k]: the tokens' whole routing
    others = (routed >= 0) & (mine < 0)  # [T_w, k]: slots other holders compute
    if not others.any():
        return True
    highest_mine = mine.max(axis=1)  # [T_w]: every token of a share has a slot here (-1 is lowest)
    lowest_other = np.where(others, routed, np.iinfo(routed.dtype).max).min(axis=1)  # [T_w]
    return bool((highest_mine < lowest_other).all())
