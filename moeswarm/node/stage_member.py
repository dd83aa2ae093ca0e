"""A stages swarm's joined member keeping a span where the swarm needs it (`join INVITE --rebalance SECONDS`).

Every period the member reads the stage records of its model on the DHT (the online ones), puts
itself in at its span (its record may not have spread yet), counts the holders of each span, and
asks placement/stage_move.py's `stage_move`, with the counts of its previous read (none at the
first: it stays), whether it is the one to move to a thinner span: one held by at least 2 fewer
stages than its own, and by no more at the previous read, while it has its span's smallest address.
Every member reads the same records and applies the same rule, so one holder at most leaves a
span in a round. The move, in an order that never leaves a span without a holder:

1. fetch the new span's slice (discovery/stage_joining.py `fetch_stage_slice`: hashed,
   resumable) and load it into a second stage node on a free port, beside the one serving;
2. announce it (on the same DHT node): for a while the swarm sees this member at both spans;
3. withdraw the old node's record (stored offline: gateways that look now find only the new
   one) and keep the old node answering for `grace_s`, then until it computed no step for
   QUIET_POLLS polls in a row (a gateway whose chain holds it steps on until it fails over),
   at most DRAIN_MAX_GRACES graces; then close it, and `on_move` (the old slice's file removed).

A gateway still holding the closed stage in its chain fails over to the span's other holder,
which replays the logged steps (stages/client.py): outputs stay bit-identical.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from moeswarm.errors import one_line
from moeswarm.placement.stage_cut import holders_per_span
from moeswarm.placement.stage_move import stage_move

if TYPE_CHECKING:
    from moeswarm.stages.node import StageNode

GRACE_S = 2.0  # the old node answers at least this long after its withdrawal,
POLL_S = 0.5  # then until its step count stays the same
QUIET_POLLS = 2  # for this many polls in a row,
DRAIN_MAX_GRACES = 30  # and at most this many graces in all


def span_text(span: range) -> str:
    return f"{span.start}-{span.stop - 1}"


def stages_text(count: int) -> str:
    """"no stage", "1 stage", "3 stages"."""
    return "no stage" if count == 0 else f"{count} stage{'s' * (count != 1)}"


class StageMember:
    """A joined member of a stages swarm: the stage node serving its span, replaced when it moves.

    cut: the swarm's spans. open_node(span): fetch that span's slice and build its node on the
    member's DHT node, not started (blocking). read(): {address: span} of the online stage records
    of the model (blocking). fits(span): whether the span fits the member's memory (a move that
    does not is reported and not made). on_move(old span): called once the old node is closed.
    on_stop(): called when serving ends, before the node closes (and leaves the DHT)."""

    def __init__(self, node: StageNode, cut: Sequence[range], open_node: Callable[[range], StageNode],
                 read: Callable[[], Mapping[str, range]], report: Callable[[str], None],
                 fits: Callable[[range], bool] = lambda span: True, on_move: Callable[[range], None] | None = None,
                 on_stop: Callable[[], None] | None = None, grace_s: float = GRACE_S, poll_s: float = POLL_S):
        self.node = node
        self.cut = list(cut)
        self.open_node = open_node
        self.read = read
        self.report = report
        self.fits = fits
        self.on_move = on_move
        self.on_stop = on_stop
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.moves = 0
        self.steps = 0  # steps of the nodes closed after a move
        self._before: list[int] | None = None  # holders per span of the cut at the previous read

    @property
    def span(self) -> range:
        return self.node.options.span

    def serve(self, stop: threading.Event, interval_s: float) -> None:
        """Start the node, look every `interval_s` (0: never) and move when this member is the one
        to, until `stop`; then withdraw and close the node."""
        try:
            self.node.start()
            while not stop.wait(interval_s if interval_s > 0 else None):
                try:
                    self.step(stop)
                except Exception as error:  # a failed fetch, a DHT hiccup: the old span serves on; next round tries again
                    self.report(f"rebalancing: {one_line(error)}")
        finally:
            try:
                if self.on_stop is not None:
                    self.on_stop()
            finally:
                self.node.close()

    def step(self, stop: threading.Event | None = None) -> range | None:
        """One round: read the swarm's stages, and move if this member is the one to."""
        announcer = self.node.announcer
        if announcer is None:
            return None
        me = announcer.record.address
        stages = {**self.read(), me: self.span}
        count = holders_per_span(self.cut, stages.values())
        before, self._before = self._before, count
        target = stage_move(self.cut, stages, me, before)
        if target is None:
            return None
        old = self.node
        held = stages_text(count[self.cut.index(target)])
        if not self.fits(target):
            self.report(f"rebalancing: layers {span_text(target)} have {held} but do not fit this member's "
                        "memory: staying")
            return None
        self.report(f"rebalancing: layers {span_text(target)} have {held}; moving there from layers "
                    f"{span_text(old.options.span)} (held by {count[self.cut.index(old.options.span)]})")
        new = self.open_node(target)
        try:
            new.start()
        except BaseException:
            new.dht = None  # shared with the node serving
            new.close()
            raise
        self.node, old.dht = new, None
        self.moves += 1
        old.withdraw()
        self.report(f"moved: layers {span_text(target)} announced as {new.announcer.record.address}; layers "
                    f"{span_text(old.options.span)} withdrawn, closing once gateways have left them "
                    f"(at least {self.grace_s:g} s)")
        self._drain(old, stop or threading.Event())
        old.close()
        self.steps += old.steps
        if self.on_move is not None:
            self.on_move(old.options.span)
        return target

    def _drain(self, old: StageNode, stop: threading.Event) -> None:
        """Keep the withdrawn node answering for `grace_s`, then until it computed no step for
        QUIET_POLLS polls in a row, at most DRAIN_MAX_GRACES graces in all; `stop` ends it at once."""
        if stop.wait(self.grace_s):
            return
        steps, quiet = old.steps, 0
        for _ in range(int((DRAIN_MAX_GRACES - 1) * self.grace_s / self.poll_s)):
            if quiet >= QUIET_POLLS or stop.wait(self.poll_s):
                return
            quiet, steps = (quiet + 1 if old.steps == steps else 0), old.steps
        self.report(f"closing layers {span_text(old.options.span)}: still stepped after "
                    f"{DRAIN_MAX_GRACES * self.grace_s:g} s (gateways fail over to the span's other stage)")
