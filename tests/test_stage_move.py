"""Who of a stages swarm's members moves to a span nobody holds (placement/stage_move.py), by hand
and over every small swarm: every member applying the rule alone, the moves together never empty
a span, fill as many holes as there are crowded spans, and repeated rounds leave no hole."""

from __future__ import annotations

import itertools

import pytest

from moeswarm.placement.stage_cut import cut_layers, holders_per_span
from moeswarm.placement.stage_move import empty_spans, stage_move

CUT = cut_layers(6, 2)  # 0-2, 3-5


def test_by_hand():
    stages = {"127.0.0.1:7001": CUT[0], "127.0.0.1:7000": CUT[0]}
    holes = empty_spans(CUT, stages)
    assert holes == {CUT[1]}
    assert stage_move(CUT, stages, "127.0.0.1:7000", set()) is None  # empty for one read only: nobody moves
    assert stage_move(CUT, stages, "127.0.0.1:7000", holes) == CUT[1]  # the smallest address of the crowded span
    assert stage_move(CUT, stages, "127.0.0.1:7001", holes) is None
    one_each = {"a:1": CUT[0], "b:1": CUT[1]}
    assert stage_move(CUT, one_each, "a:1", {CUT[1]}) is None  # no hole now: nothing to do
    alone = {"a:1": CUT[0], "b:1": range(0, 6)}  # a stage of another span holds none of the cut's
    assert stage_move(CUT, alone, "a:1", {CUT[1]}) is None  # a span with one holder is never left
    with pytest.raises(ValueError, match="not among the stages read"):
        stage_move(CUT, one_each, "c:1", set())


def test_the_most_held_span_gives_first_and_holes_fill_in_layer_order():
    cut = cut_layers(8, 4)
    stages = {"a:1": cut[0], "b:1": cut[0], "c:1": cut[1], "d:1": cut[1], "e:1": cut[1]}
    holes = empty_spans(cut, stages)
    moves = {me: stage_move(cut, stages, me, holes) for me in stages}
    assert moves == {"a:1": cut[3], "b:1": None, "c:1": cut[2], "d:1": None, "e:1": None}


ADDRESSES = ["a:1", "b:1", "c:1", "d:1", "e:1"]


def _moves(cut, stages, empty_before):
    return {me: target for me in stages if (target := stage_move(cut, stages, me, empty_before)) is not None}


def test_every_small_swarm_against_the_invariants():
    """Every assignment of up to 5 stages to the spans of a cut into 3 (or to a span outside it),
    every previous read: the moves of all members applying the rule alone."""
    cut = cut_layers(6, 3)
    choices = [*cut, range(0, 6)]
    checked = 0
    for n in range(1, 6):
        for spans in itertools.product(choices, repeat=n):
            stages = dict(zip(ADDRESSES, spans))
            holders = holders_per_span(cut, stages.values())
            for before in itertools.product((False, True), repeat=len(cut)):
                empty_before = {span for span, was in zip(cut, before) if was}
                moves = _moves(cut, stages, empty_before)
                holes = [s for s, c in zip(cut, holders) if c == 0 and s in empty_before]
                crowded = [s for s, c in zip(cut, holders) if c >= 2]
                assert len(moves) == min(len(holes), len(crowded))  # as many as can move
                assert len(set(moves.values())) == len(moves) and set(moves.values()) <= set(holes)
                left = [stages[me] for me in moves]
                assert len(set(left)) == len(left) and set(left) <= set(crowded)  # one holder per span at most
                for me in moves:  # the smallest address of its span
                    assert me == min(a for a, s in stages.items() if s == stages[me])
                after = {**stages, **moves}
                now = holders_per_span(cut, after.values())
                assert all(c >= 1 for c, was in zip(now, holders) if was >= 1)  # no span emptied
                checked += 1
    assert checked > 5000


def test_rounds_leave_no_hole_once_there_are_stages_enough():
    cut = cut_layers(12, 4)
    for spans in itertools.product(cut, repeat=5):
        stages = dict(zip(ADDRESSES, spans))
        empty_before: frozenset = frozenset()
        for _ in range(2 * len(cut) + 2):
            holes = empty_spans(cut, stages)
            stages = {**stages, **_moves(cut, stages, empty_before)}
            empty_before = holes
        assert empty_spans(cut, stages) == frozenset(), stages
