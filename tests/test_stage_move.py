"""Who of a stages swarm's members moves to a thinner span (placement/stage_move.py), by hand and
over every small swarm: every member applying the rule alone, the moves together never empty a
span, take at most one holder from a span, each from a span held at least 2 more times than its
target, as many as there are such pairs; and repeated rounds even the counts out to within one."""

from __future__ import annotations

import itertools

import pytest

from moeswarm.placement.stage_cut import cut_layers, holders_per_span
from moeswarm.placement.stage_move import stage_move, thin_pairs

CUT = cut_layers(6, 2)  # 0-2, 3-5


def test_a_hole_by_hand():
    stages = {"127.0.0.1:7001": CUT[0], "127.0.0.1:7000": CUT[0]}
    now = holders_per_span(CUT, stages.values())
    assert now == [2, 0]
    assert stage_move(CUT, stages, "127.0.0.1:7000", None) is None  # no previous read: nobody moves
    assert stage_move(CUT, stages, "127.0.0.1:7000", [1, 1]) is None  # empty for one read only: nobody moves
    assert stage_move(CUT, stages, "127.0.0.1:7000", now) == CUT[1]  # the smallest address of the crowded span
    assert stage_move(CUT, stages, "127.0.0.1:7001", now) is None
    one_each = {"a:1": CUT[0], "b:1": CUT[1]}
    assert stage_move(CUT, one_each, "a:1", [1, 0]) is None  # no hole now: nothing to do
    alone = {"a:1": CUT[0], "b:1": range(0, 6)}  # a stage of another span holds none of the cut's
    assert stage_move(CUT, alone, "a:1", [1, 0]) is None  # a span with one holder is never left
    with pytest.raises(ValueError, match="not among the stages read"):
        stage_move(CUT, one_each, "c:1", [1, 1])


def test_a_thin_span_by_hand():
    three_one = {"c:1": CUT[0], "a:1": CUT[0], "b:1": CUT[0], "d:1": CUT[1]}
    assert _moves(CUT, three_one, [3, 1]) == {"a:1": CUT[1]}  # 3 + 1 -> 2 + 2: the smallest address of the 3
    assert _moves(CUT, three_one, [3, 2]) == {}  # 3-5 lost a holder at this read only: nobody moves yet
    assert _moves(CUT, three_one, [4, 0]) == {"a:1": CUT[1]}  # thicker now than before: still a target
    assert _moves(CUT, {"a:1": CUT[0], "b:1": CUT[0], "c:1": CUT[1]}, [2, 1]) == {}  # 2 + 1: a move would not even it
    assert _moves(CUT, {"a:1": CUT[0], "b:1": CUT[0], "c:1": CUT[1], "d:1": CUT[1]}, [2, 2]) == {}
    assert thin_pairs(CUT, [3, 1], None) == [] and thin_pairs(CUT, [3, 1], [3, 1]) == [(1, 0)]
    with pytest.raises(ValueError, match="equally long"):
        thin_pairs(CUT, [3, 1], [3])


def test_the_most_held_span_gives_first_and_the_thinnest_span_takes_first():
    cut = cut_layers(8, 4)
    stages = {"a:1": cut[0], "b:1": cut[0], "c:1": cut[1], "d:1": cut[1], "e:1": cut[1]}
    now = holders_per_span(cut, stages.values())  # [2, 3, 0, 0]
    assert _moves(cut, stages, now) == {"a:1": cut[3], "c:1": cut[2]}  # holes in layer order
    stages = {"a:1": cut[0], "b:1": cut[0], "c:1": cut[0], "d:1": cut[0], "e:1": cut[1], "f:1": cut[1],
              "g:1": cut[1], "h:1": cut[2], "i:1": cut[2], "j:1": cut[3]}
    now = holders_per_span(cut, stages.values())  # [4, 3, 2, 1]
    assert _moves(cut, stages, now) == {"a:1": cut[3]}  # 4 -> 1; then 3 and 2 are within a move of even
    assert _moves(cut, {**stages, "k:1": cut[1]}, [4, 4, 2, 1]) == {"a:1": cut[3], "e:1": cut[2]}


ADDRESSES = ["a:1", "b:1", "c:1", "d:1", "e:1"]


def _moves(cut, stages, before):
    return {me: target for me in stages if (target := stage_move(cut, stages, me, before)) is not None}


def _valid_pairs(count, before, cut):
    """How many (target, donor) pairs of the orders the rule states pass the margin (not stopping)."""
    targets = sorted((i for i in range(len(cut)) if before[i] <= count[i]), key=lambda i: (count[i], cut[i].start))
    donors = sorted((i for i in range(len(cut)) if count[i] >= 2), key=lambda i: (-count[i], cut[i].start))
    return sum(count[d] >= count[t] + 2 for t, d in zip(targets, donors))


def test_every_small_swarm_against_the_invariants():
    """Every assignment of up to 5 stages to the spans of a cut into 3 (or to a span outside it),
    every previous read with each span's count one fewer, the same or one more: the moves of all
    members applying the rule alone."""
    cut = cut_layers(6, 3)
    choices = [*cut, range(0, 6)]
    checked = moved = 0
    for n in range(1, 6):
        for spans in itertools.product(choices, repeat=n):
            stages = dict(zip(ADDRESSES, spans))
            count = holders_per_span(cut, stages.values())
            assert _moves(cut, stages, None) == {}  # no previous read
            for before in itertools.product(*[[c + d for d in (-1, 0, 1) if c + d >= 0] for c in count]):
                moves = _moves(cut, stages, before)
                pairs = [(cut.index(target), cut.index(stages[me])) for me, target in moves.items()]  # (target, donor)
                assert len(moves) == _valid_pairs(count, before, cut)  # as many as can move
                given = [d for _, d in pairs]
                taken = [t for t, _ in pairs]
                assert len(set(given)) == len(given) and len(set(taken)) == len(taken)  # one per span at most
                assert not set(given) & set(taken)  # no span both gives and receives
                for t, d in pairs:
                    assert count[d] >= count[t] + 2  # every move strictly evens its pair
                    assert before[t] <= count[t]  # a span thinner only at this read takes nobody
                for me in moves:  # the smallest address of its span
                    assert me == min(a for a, s in stages.items() if s == stages[me])
                after = holders_per_span(cut, {**stages, **moves}.values())
                assert all(a >= 1 for a, c in zip(after, count) if c >= 1)  # no span emptied
                checked += 1
                moved += bool(moves)
    assert (checked, moved) == (27580, 9126)


def test_rounds_even_the_spans_out():
    """Every assignment of 5 stages to 4 spans, each round's previous read the last round's: within
    4 rounds (the first only reads) every span is held once or twice, and then nobody moves."""
    cut = cut_layers(12, 4)
    slowest = 0
    for spans in itertools.product(cut, repeat=5):
        stages = dict(zip(ADDRESSES, spans))
        before, rounds = None, 0
        while max(count := holders_per_span(cut, stages.values())) - min(count) > 1:
            assert rounds < 8, stages
            stages, before = {**stages, **_moves(cut, stages, before)}, count
            rounds += 1
        assert _moves(cut, stages, count) == {}  # even: it stays so
        slowest = max(slowest, rounds)
    assert slowest == 4  # all 5 on one span: a read, then 4+1, 3+1+1, 2+1+1+1 (one donor: one move a round)
