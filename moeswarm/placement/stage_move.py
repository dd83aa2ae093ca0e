"""Which stage member of a stages swarm moves to a span nobody holds, this round (pure).

A stages swarm's members (`moeswarm join INVITE`, placement/stage_cut.py) read the stage records
every `--rebalance` seconds. When a span of the cut has no stage (its last holder died or left)
while another has several, one holder of the crowded span moves to the empty one. Every member
reads the same records and applies the same rule, so members agree on who moves without talking:

- a hole is a span held by no stage now *and* at the member's previous read (a record missing
  for one read, a refresh late on a loaded host, moves nobody);
- the donors are the spans held by at least 2 stages, the most held first (ties: the lowest
  layer); holes in layer order are paired with donors in that order, one hole per donor;
- of a donor span's holders, the one with the smallest address moves.

So at most one holder leaves a span in a round, and a span with one holder is never left.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from moeswarm.placement.stage_cut import holders_per_span


def empty_spans(cut: Sequence[range], stages: Mapping[str, range]) -> frozenset[range]:
    """The spans of `cut` that no stage of `stages` ({address: span}) holds exactly."""
    return frozenset(span for span, count in zip(cut, holders_per_span(cut, stages.values())) if count == 0)


def stage_move(cut: Sequence[range], stages: Mapping[str, range], me: str,
               empty_before: Collection[range]) -> range | None:
    """The span the stage at address `me` moves to this round, or None (it stays).

    cut: the swarm's spans, in layer order. stages: {address: span} of the online stage records
    read now; `me` is counted at the span it gives (put it in: its own record may not have spread
    yet). empty_before: the spans no stage held at the previous read (`empty_spans`)."""
    if me not in stages:
        raise ValueError(f"{me} is not among the stages read")
    holders = holders_per_span(cut, stages.values())
    holes = [span for span, count in zip(cut, holders) if count == 0 and span in empty_before]
    donors = sorted((i for i, count in enumerate(holders) if count >= 2), key=lambda i: (-holders[i], cut[i].start))
    for hole, donor in zip(holes, donors):
        mover = min(address for address, span in stages.items() if span == cut[donor])
        if mover == me:
            return hole
    return None
