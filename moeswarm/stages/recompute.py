"""A step computed again when a holder it used is banned during it: the stage's side of the engine's rollback.

The gateway's engine rolls a sequence back when a holder whose unchecked answers its step used is
banned (serve/rollback.py, dispatch/taint.py). A stage's steps use its own swarm's holders; a
liar found out (spot check, bad answer) while a step runs has put its answers into that step's
hidden states and into the keys and values the step filed. So a stage marks its caches before the
span runs (`mark`: each cache's lengths, branches aside and rows; what a step adds is appended
past them, so a mark costs no copy of keys or values), and when a taint hits one of the step's
layer calls it restores the marks and runs the span again, the liar now banned: what leaves the
stage, and what its caches keep, is what an honest run computes.

A ban found after a step's hidden states have left the stage is not undone here: the stage has no
record of which of its past steps used the holder (see docs/stages.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeswarm.generation.sequence_cache import SequenceCache

MAX_RECOMPUTES = 4  # bans during one step's recomputations before the step fails instead


@dataclass(frozen=True)
class Mark:
    """One cache as it was before a step."""

    lengths: dict[int, int]
    pending: dict[int, dict[int, tuple]]
    rows: int


def mark(caches: list[SequenceCache]) -> list[Mark]:
    return [Mark(dict(c.lengths), {layer: dict(held) for layer, held in c.pending.items()}, c.rows) for c in caches]


def restore(caches: list[SequenceCache], marks: list[Mark]) -> None:
    """Each cache back to its mark (a cache appears once per segment: restored each time, to the same mark)."""
    for cache, point in zip(caches, marks):
        cache.lengths = dict(point.lengths)
        cache.pending = {layer: dict(held) for layer, held in point.pending.items()}
        cache.rows = point.rows
