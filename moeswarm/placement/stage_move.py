"""Which stage member of a stages swarm moves to a thinner span, this round (pure).

A stages swarm's members (`moeswarm join INVITE`, placement/stage_cut.py) read the stage records
every `--rebalance` seconds. A gateway fails over to a span's other holders (stages/client.py), so
a span held once is one departure from a broken route: when a span is held by clearly fewer
stages than another (a span that lost every stage, or 3 + 1 on two spans after kills and
rejoins), one holder of the crowded span moves to the thin one. Every member reads the same
records and applies the same rule, so members agree on who moves without talking:

    count[s]   stages holding span s at this read (`holders_per_span`)
    before[s]  the same at the member's previous read (none yet: nobody moves)

- the **targets** are the spans with before[s] <= count[s], as thin at the previous read as now
  (a span whose count dropped only at this read, a record refresh late on a loaded host, moves
  nobody; for a hole this is "empty now and at the previous read"), fewest holders first (ties:
  the lowest layer), so holes come first;
- the **donors** are the spans held by at least 2 stages, the most held first (ties: the lowest
  layer);
- targets and donors pair in those orders; a pair moves only when count[donor] >= count[target]
  + 2 (Petals-like balancing by a margin: a move strictly evens the two counts, so 2 + 1 stays);
  the margins fall along the pairs, so the first pair that fails ends the round;
- of a donor span's holders, the one with the smallest address moves.

So at most one holder leaves a span in a round, a span held once is never left, no span both
gives and receives, and repeated rounds even the counts out to within one (tests/test_stage_move.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moeswarm.placement.stage_cut import holders_per_span


def thin_pairs(cut: Sequence[range], count: Sequence[int], before: Sequence[int] | None) -> list[tuple[int, int]]:
    """The (target, donor) indices into `cut` that move this round: one holder of each donor span
    moves to its target span. count, before: holders per span of `cut` now and at the previous read
    (None: there was none, and nobody moves)."""
    if before is None:
        return []
    if not len(cut) == len(count) == len(before):
        raise ValueError("cut, count and before must be equally long")
    targets = sorted((i for i in range(len(cut)) if before[i] <= count[i]), key=lambda i: (count[i], cut[i].start))
    donors = sorted((i for i in range(len(cut)) if count[i] >= 2), key=lambda i: (-count[i], cut[i].start))
    pairs = []
    for target, donor in zip(targets, donors):
        if count[donor] < count[target] + 2:  # targets thicken and donors thin along the pairs: no later one passes
            break
        pairs.append((target, donor))
    return pairs


def stage_move(cut: Sequence[range], stages: Mapping[str, range], me: str,
               before: Sequence[int] | None) -> range | None:
    """The span the stage at address `me` moves to this round, or None (it stays).

    cut: the swarm's spans, in layer order. stages: {address: span} of the online stage records
    read now; `me` is counted at the span it gives (put it in: its own record may not have spread
    yet). before: `holders_per_span(cut, ...)` of the member's previous read, None before its
    first."""
    if me not in stages:
        raise ValueError(f"{me} is not among the stages read")
    for target, donor in thin_pairs(cut, holders_per_span(cut, stages.values()), before):
        if min(address for address, span in stages.items() if span == cut[donor]) == me:
            return cut[target]
    return None
