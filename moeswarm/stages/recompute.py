"""A step computed again when a holder it used is banned during it: the stage's side of the engine's rollback.

The gateway's engine rolls a sequence back when a holder whose unchecked answers its step used is
banned (engine/rollback.py, dispatch/taint.py). A stage's steps use its own swarm's holders; a
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

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from moeswarm.errors import MoeSwarmError, printable
from moeswarm.forward.sequence_cache import SequenceCache
from moeswarm.stages.forward import run_span
from moeswarm.stages.protocol import Segment

log = logging.getLogger("moeswarm.stage")

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


def run_honestly(model: PreTrainedModel, swarm, caches: list[SequenceCache], segments: tuple[Segment, ...],
                 hidden: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
    """run_span (hidden [T, d] -> [T, d]), again from the marks while a holder it used is banned
    during it (swarm: `layer_call_number` and `take_taints`, as a Swarm has them). Returns the
    honest hidden states and how many times the step was computed again; MoeSwarmError past
    MAX_RECOMPUTES. `what`: the step, as logs may name it."""
    for again in range(MAX_RECOMPUTES + 1):
        marks = mark(caches)
        first = swarm.layer_call_number() + 1
        out = run_span(model, caches, segments, hidden)  # [T, d]
        last = swarm.layer_call_number()
        taints = swarm.take_taints()
        if not any(taint.hits(first, last) for taint in taints):
            return out, again
        restore(caches, marks)
        log.warning("a step of session %s computed again: %s banned during it", what,
                    ", ".join(printable(t.holder, 80) for t in taints))
    raise MoeSwarmError(f"holders were banned during each of {MAX_RECOMPUTES + 1} computations of this step")
