"""Spot checks and implausible answers inside a layer call: who lied, settled by a third computation.

A drawn answer's rows go to another holder and are compared when it answers. On a difference,
a third computation settles it: the backbone's own when it was the checker (it is trusted), else a
third holder, else the backbone computing the rows itself (the `referee`, loading those experts
from the model source). Whoever differs from the third computation lied and is banned; two
holders that disagree are never both banned on each other's word. With nothing to settle it the
call fails naming both, and neither is banned. An implausible answer (a row norm far above the
layer's running statistics, dispatch/plausible.py) is settled the same way: when a third
computation is implausible too, the answer stands.

The liar's answers in this call are redone from trusted results (dispatch/spot_check.py
compares); its unchecked answers in earlier calls are reported by the pool's taint ledger.

`Verification` is the dispatcher's collaborator: it holds the policy (the spot-check draw, the
plausibility gate, the referee) and acts on a layer call through the small `FlightOps` interface
(dispatch/flight.py implements it) and on holders through the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from moeswarm.dispatch.accounting import Resilience
from moeswarm.dispatch.checks import result_problem
from moeswarm.dispatch.parts import CHECK, REFEREE, SERVE, Part
from moeswarm.dispatch.plan import share_experts
from moeswarm.dispatch.plausible import NormGate
from moeswarm.dispatch.pool import HolderPool
from moeswarm.dispatch.spot_check import SpotChecker, disagreement
from moeswarm.errors import MoeSwarmError, WorkerError, one_line
from moeswarm.ids import LayerId, WorkerId
from moeswarm.transport.fanout import send
from moeswarm.transport.link import Reply
from moeswarm.worker.local_link import LOCAL_ADDRESS
from moeswarm.wire.config import CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch, Result


class FlightOps(Protocol):
    """What verification needs of a layer call in flight."""

    layer: LayerId
    hidden: torch.Tensor  # [T, d]
    wire: WireConfig
    parts: list[Part]
    error: WorkerError | None

    def send(self, part: Part, worker: int) -> None: ...
    def cancel(self, part: Part) -> None: ...  # forget its open attempts
    def in_flight(self, part: Part) -> bool: ...  # it has open attempts
    def holder_failed(self, worker: int, cause: str) -> None: ...
    def lost(self, part: Part, worker: int, cause: str) -> None: ...


class Verification:
    def __init__(self, pool: HolderPool, checker: SpotChecker, stats: Resilience,
                 referee: Callable[[Dispatch], Result] | None = None):
        """referee: the backbone computing a request itself (dispatch/referee.py), to settle a
        dispute between two holders when no third holder can; None: only holders settle."""
        self.pool = pool
        self.checker = checker
        self.stats = stats
        self.referee = referee
        self.referee_error: str | None = None  # why the referee last failed
        self.gate = NormGate()  # plausibility of each answer's row norms (dispatch/plausible.py)

    def answered(self, flight: FlightOps, part: Part, worker: int) -> None:
        """`part` just got `worker`'s well-formed answer: gate it, maybe draw a spot check, or (a
        check's answer) compare it with the answer it checks."""
        trusted = worker in self.pool.trusted
        if part.role == SERVE and not trusted:
            problem = self.gate.problem(flight.layer, part.reply.result.outputs, part.request.hidden)
            if problem:  # (a check's answer is compared instead: a difference is settled the same way)
                self._implausible(flight, part, worker, problem)
                return
            if self.checker.draw():
                self._spot_check(flight, part)
        elif part.role == CHECK:
            checked = part.checks
            if checked.reply is None or checked.replaced:  # its answer was already thrown out
                checked.verifiers, part.replaced = [], True
            else:
                self._verify(flight, checked)

    def drop_checks(self, flight: FlightOps, checked: Part) -> None:
        """`checked`'s spot checks are abandoned (the checking holder failed first)."""
        for verifier in checked.verifiers:
            verifier.replaced = True
            flight.cancel(verifier)
        if checked.verifiers:
            self.stats.checks_dropped += 1
        checked.verifiers = []

    def _spot_check(self, flight: FlightOps, part: Part) -> None:
        """Send `part`'s rows to one other holder of all its experts (the backbone first)."""
        target = self.pool.replica_for(flight.layer, share_experts(part.share), exclude={part.winner})
        if target is None:
            self.stats.checks_skipped += 1
            return
        self.stats.checks += 1
        verifier = Part(part.share, part.request, CHECK, part)
        part.verifiers.append(verifier)
        flight.parts.append(verifier)
        flight.send(verifier, target)

    def _verify(self, flight: FlightOps, checked: Part) -> None:
        """Compare; on a difference, a third computation says who lied."""
        (verifier,), checked.verifiers = checked.verifiers, []
        verifier.replaced = True
        if self._differs(flight, checked, verifier) is None:
            checked.confirmed = True
            return
        self.stats.check_failures += 1
        if verifier.winner in self.pool.trusted:
            liars, trusted = {checked.winner}, verifier
        else:
            arbiter = self._arbitrate(flight, checked, {checked.winner, verifier.winner})
            if arbiter is None:
                self.stats.disputes_unsettled += 1
                flight.error = WorkerError(
                    self.pool.address_of(checked.winner),
                    f"answered layer {flight.layer} experts {share_experts(checked.share)} differently from "
                    f"{self.pool.address_of(verifier.winner)}, and no third holder or local copy of those experts "
                    "can settle which one lied (neither is banned)")
                return
            self.stats.disputes_settled += 1
            liars = {p.winner for p in (checked, verifier) if self._differs(flight, p, arbiter) is not None}
            trusted = verifier if verifier.winner not in liars else arbiter
        checker = self._address(trusted.winner)
        self._convict(flight, liars, checked, trusted, f"failed a spot check at layer {flight.layer} (settled by {checker})")

    def _implausible(self, flight: FlightOps, part: Part, worker: int, problem: str) -> None:
        """`part` just got `worker`'s implausible answer: a third computation confirms before a ban."""
        self.stats.implausible += 1
        arbiter = self._arbitrate(flight, part, {worker})
        if arbiter is not None and self.gate.problem(flight.layer, arbiter.reply.result.outputs,
                                                     part.request.hidden) is not None:
            return  # the third computation is as large: the statistics were wrong, not the holder
        if arbiter is None:  # nothing to confirm with: out of use (probed later), not banned
            part.reply, part.winner = None, None
            flight.holder_failed(worker, problem)
            if not part.done and not flight.in_flight(part):
                flight.lost(part, worker, problem)
            return
        self._convict(flight, {worker}, part, arbiter, problem)

    def _convict(self, flight: FlightOps, liars: set[int], checked: Part, trusted: Part, cause: str) -> None:
        """Ban `liars`; `checked`'s rows come from `trusted`, and every other answer of a liar in this call is redone."""
        for liar in sorted(liars):
            self.pool.ban(WorkerId(liar), cause)
        if checked.winner in liars:  # the recomputed rows replace the liar's
            trusted.role, trusted.checks, trusted.replaced = SERVE, None, False
            checked.replaced = True
            if trusted not in flight.parts:
                flight.parts.append(trusted)
        for part in flight.parts:  # whatever else a liar answered in this call is redone
            if part.role == SERVE and part.winner in liars and not part.replaced:
                part.reply, part.winner = None, None
        for liar in sorted(liars):
            flight.holder_failed(liar, "banned: " + cause)
        for part in list(flight.parts):
            if part.role == SERVE and not part.done and not flight.in_flight(part):
                flight.lost(part, next(iter(liars)), "banned: " + cause)

    def _differs(self, flight: FlightOps, part: Part, other: Part) -> str | None:
        wire = flight.wire
        lossless = wire.dispatch_codec is None and wire.combine_codec is None
        return disagreement(part.request.mode, lossless, self.checker.policy.min_cosine, flight.hidden.shape[0],
                            (part.share, part.reply.result), [(other.share, other.reply.result)],
                            exact_sums=lossless and wire.mode == CombineMode.EXACT)

    def _arbitrate(self, flight: FlightOps, checked: Part, exclude: set[int]) -> Part | None:
        """A third computation of `checked`'s rows, awaited here (rare: only after a difference): a
        third holder's, else the backbone's own (the referee); None when neither can be had."""
        pool = self.pool
        while (target := pool.replica_for(flight.layer, share_experts(checked.share), exclude)) is not None:
            link = pool.links[target]
            try:
                if not pool.ready(target, first_ping=False):
                    raise WorkerError(link.address, pool.holders[target].cause)
                pending = send(pool.links, target, checked.request).pending
                rows = checked.share.tokens.numel()
                reply = link.wait(pending, time.monotonic() + pool.holders[target].deadline_s(rows))
                problem = result_problem(checked.share, flight.layer, checked.request.mode, flight.hidden.shape[1],
                                         reply.result, checked.request.hidden)
                if problem:
                    raise WorkerError(link.address, problem)
            except WorkerError as error:
                flight.holder_failed(target, error.cause)
                exclude = exclude | {target}
                continue
            return Part(checked.share, checked.request, CHECK, checked, {target}, reply, target)
        if self.referee is None:
            return None
        started = time.perf_counter()
        try:
            result = self.referee(checked.request)
        except (MoeSwarmError, OSError, ValueError) as error:
            self.referee_error = one_line(error)
            return None
        reply = Reply(result, 0, time.perf_counter() - started)
        self.stats.referee_computations += 1
        return Part(checked.share, checked.request, CHECK, checked, set(), reply, REFEREE)

    def _address(self, worker: int) -> str:
        return LOCAL_ADDRESS if worker == REFEREE else self.pool.address_of(worker)
