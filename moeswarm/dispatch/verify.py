"""Spot checks inside a layer call: send a drawn answer's rows to another holder, compare, and
when they differ find out who lied (the backbone decides when it checked; otherwise a third
holder; with no third, neither holder is trusted again). The liar is banned and whatever it
answered in this call is redone from trusted results (dispatch/spot_check.py compares).

A mixin of `Flight` (dispatch/flight.py): it uses the flight's parts, open attempts and helpers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from moeswarm.dispatch.checks import result_problem
from moeswarm.dispatch.plan import share_experts
from moeswarm.dispatch.spot_check import disagreement
from moeswarm.errors import WorkerError
from moeswarm.ids import WorkerId
from moeswarm.transport.fanout import ready, send

if TYPE_CHECKING:
    from moeswarm.dispatch.flight import Part

SERVE, CHECK = "serve", "check"


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
        """Compare; on a difference, find out who lied (the backbone, else a third holder, decides)."""
        (verifier,), checked.verifiers = checked.verifiers, []
        verifier.replaced = True
        if self._differs(checked, verifier) is None:
            return
        self.d.stats.check_failures += 1
        if verifier.winner in self.d.trusted:
            liars, trusted = {checked.winner}, verifier
        else:
            arbiter = self._arbitrate(checked, {checked.winner, verifier.winner})
            if arbiter is None:  # two holders disagree and nobody can tell which lied: neither is used again
                liars, trusted = {checked.winner, verifier.winner}, None
            else:
                liars = {p.winner for p in (checked, verifier) if self._differs(p, arbiter) is not None}
                trusted = arbiter
        for liar in sorted(liars):
            self.d.ban(WorkerId(liar), f"failed a spot check at layer {self.layer} "
                                       f"(checked by {self.d.links[verifier.winner].address})")
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
            self._holder_failed(liar, "banned after a failed spot check")
        for part in list(self.parts):
            if part.role == SERVE and not part.done and not self._attempts_of(part):
                self._lost(part, next(iter(liars)), "banned after a failed spot check")

    def _differs(self, part: Part, other: Part) -> str | None:
        wire = self.d.wire
        return disagreement(part.request.mode, wire.dispatch_codec is None and wire.combine_codec is None,
                            self.d.checker.policy.min_cosine, self.hidden.shape[0],
                            (part.share, part.reply.result), [(other.share, other.reply.result)])

    def _arbitrate(self, checked: Part, exclude: set[int]) -> Part | None:
        """A third holder's answer to `checked`'s rows, awaited here (rare: only after a difference)."""
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
        return None

