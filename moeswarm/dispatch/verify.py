"""Spot checks and implausible answers inside a layer call: who lied, settled by a third computation.

A drawn answer's rows go to another holder and are compared when it answers. On a difference,
a third computation settles it: the backbone's own when it was the checker (it is trusted), else a
third holder, else the backbone computing the rows itself (the dispatcher's `referee`, loading
those experts from the model source). Whoever differs from the third computation lied and is
banned; two holders that disagree are never both banned on each other's word. With nothing to
settle it the call fails naming both, and neither is banned. An implausible answer (a row norm
far above the layer's running statistics, dispatch/plausible.py) is settled the same way: when
a third computation is implausible too, the answer stands.

The liar's answers in this call are redone from trusted results (dispatch/spot_check.py
compares); its unchecked answers in earlier calls are reported by the dispatcher's taint ledger.

A mixin of `Flight` (dispatch/flight.py): it uses the flight's parts, open attempts and helpers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from moeswarm.dispatch.checks import result_problem
from moeswarm.dispatch.plan import share_experts
from moeswarm.dispatch.spot_check import disagreement
from moeswarm.errors import MoeSwarmError, WorkerError, one_line
from moeswarm.ids import WorkerId
from moeswarm.transport.fanout import ready, send
from moeswarm.transport.link import Reply

if TYPE_CHECKING:
    from moeswarm.dispatch.flight import Part

SERVE, CHECK = "serve", "check"
REFEREE = -1  # the winner of a part the backbone computed itself (dispatcher `referee`)


class Verification:
    def _spot_check(self, part: Part) -> None:
        """Send `part`'s rows to one other holder of all its experts (the backbone first)."""
        target = self.d.replica_for(self.layer, share_experts(part.share), exclude={part.winner})
        if target is None:
            self.d.stats.checks_skipped += 1
            return
        self.d.stats.checks += 1
        verifier = type(part)(part.share, part.request, CHECK, part)
        part.verifiers.append(verifier)
        self.parts.append(verifier)
        self._send(verifier, target)

    def _drop_check(self, checked: Part) -> None:
        for verifier in checked.verifiers:
            verifier.replaced = True
            for attempt in self._attempts_of(verifier):
                self.open.remove(attempt)
                self.d.links[attempt.worker].forget(attempt.pending)
        if checked.verifiers:
            self.d.stats.checks_dropped += 1
        checked.verifiers = []

    def _verify(self, checked: Part) -> None:
        """Compare; on a difference, a third computation says who lied."""
        (verifier,), checked.verifiers = checked.verifiers, []
        verifier.replaced = True
        if self._differs(checked, verifier) is None:
            checked.confirmed = True
            return
        self.d.stats.check_failures += 1
        if verifier.winner in self.d.trusted:
            liars, trusted = {checked.winner}, verifier
        else:
            arbiter = self._arbitrate(checked, {checked.winner, verifier.winner})
            if arbiter is None:
                self.d.stats.disputes_unsettled += 1
                self.error = WorkerError(
                    self.d.links[checked.winner].address,
                    f"answered layer {self.layer} experts {share_experts(checked.share)} differently from "
                    f"{self.d.links[verifier.winner].address}, and no third holder or local copy of those experts "
                    "can settle which one lied (neither is banned)")
                return
            self.d.stats.disputes_settled += 1
            liars = {p.winner for p in (checked, verifier) if self._differs(p, arbiter) is not None}
            trusted = verifier if verifier.winner not in liars else arbiter
        checker = self.d.address_of(trusted.winner if trusted is not None else verifier.winner)
        self._convict(liars, checked, trusted, f"failed a spot check at layer {self.layer} (settled by {checker})")

    def _implausible(self, part: Part, worker: int, problem: str) -> None:
        """`part` just got `worker`'s implausible answer: a third computation confirms before a ban."""
        self.d.stats.implausible += 1
        arbiter = self._arbitrate(part, {worker})
        if arbiter is not None and self.d.gate.problem(self.layer, arbiter.reply.result.outputs,
                                                        part.request.hidden) is not None:
            return  # the third computation is as large: the statistics were wrong, not the holder
        if arbiter is None:  # nothing to confirm with: out of use (probed later), not banned
            part.reply, part.winner = None, None
            self._holder_failed(worker, problem)
            if not part.done and not self._attempts_of(part):
                self._lost(part, worker, problem)
            return
        self._convict({worker}, part, arbiter, problem)

    def _convict(self, liars: set[int], checked: Part, trusted: Part | None, cause: str) -> None:
        """Ban `liars`; `checked`'s rows come from `trusted`, and every other answer of a liar in this call is redone."""
        for liar in sorted(liars):
            self.d.ban(WorkerId(liar), cause)
        if checked.winner in liars:
            if trusted is not None:  # the recomputed rows replace the liar's
                trusted.role, trusted.checks, trusted.replaced = SERVE, None, False
                checked.replaced = True
                if trusted not in self.parts:
                    self.parts.append(trusted)
            else:
                checked.reply = None
        for part in self.parts:  # whatever else a liar answered in this call is redone
            if part.role == SERVE and part.winner in liars and not part.replaced:
                part.reply, part.winner = None, None
        for liar in sorted(liars):
            self._holder_failed(liar, "banned: " + cause)
        for part in list(self.parts):
            if part.role == SERVE and not part.done and not self._attempts_of(part):
                self._lost(part, next(iter(liars)), "banned: " + cause)

    def _differs(self, part: Part, other: Part) -> str | None:
        wire = self.d.wire
        return disagreement(part.request.mode, wire.dispatch_codec is None and wire.combine_codec is None,
                            self.d.checker.policy.min_cosine, self.hidden.shape[0],
                            (part.share, part.reply.result), [(other.share, other.reply.result)])

    def _arbitrate(self, checked: Part, exclude: set[int]) -> Part | None:
        """A third computation of `checked`'s rows, awaited here (rare: only after a difference): a
        third holder's, else the backbone's own (the referee); None when neither can be had."""
        while (target := self.d.replica_for(self.layer, share_experts(checked.share), exclude)) is not None:
            link = self.d.links[target]
            try:
                ready(link, self.d.policy.probe_timeout_s)
                pending = send(self.d.links, target, checked.request).pending
                rows = checked.share.tokens.numel()
                reply = link.wait(pending, time.monotonic() + self.d.holders[target].deadline_s(rows))
                problem = result_problem(checked.share, self.layer, checked.request.mode, self.hidden.shape[1],
                                         reply.result, checked.request.hidden)
                if problem:
                    raise WorkerError(link.address, problem)
            except WorkerError as error:
                self._holder_failed(target, error.cause)
                exclude = exclude | {target}
                continue
            return type(checked)(checked.share, checked.request, CHECK, checked, {target}, reply, target)
        if self.d.referee is None:
            return None
        started = time.perf_counter()
        try:
            result = self.d.referee(checked.request)
        except (MoeSwarmError, OSError, ValueError) as error:
            self.d.referee_error = one_line(error)
            return None
        reply = Reply(result, 0, time.perf_counter() - started)
        self.d.stats.referee_computations += 1
        return type(checked)(checked.share, checked.request, CHECK, checked, set(), reply, REFEREE)
