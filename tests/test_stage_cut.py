"""A stages swarm's cut and a joiner's span (placement/stage_cut.py), the chooser against brute force."""

from __future__ import annotations

import itertools

import pytest

from moeswarm.errors import MoeSwarmError
from moeswarm.placement.stage_cut import choose_span, cut_layers, default_stage_count, holders_per_span


def test_the_cut_tiles_the_layers_evenly_longer_spans_first():
    assert cut_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert cut_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert cut_layers(1, 1) == [range(0, 1)]
    for layers in range(1, 40):
        for count in range(1, layers + 1):
            cut = cut_layers(layers, count)
            assert [s.start for s in cut[1:]] == [s.stop for s in cut[:-1]] and cut[0].start == 0
            assert cut[-1].stop == layers and len(cut) == count
            lengths = [len(s) for s in cut]
            assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("layers, count", [(6, 0), (6, 7), (0, 1)])
def test_an_impossible_cut_is_refused(layers, count):
    with pytest.raises(ValueError, match="cannot cut"):
        cut_layers(layers, count)


def test_the_default_count():
    assert [default_stage_count(n) for n in (1, 2, 6, 16, 17, 48, 61)] == [1, 2, 2, 2, 3, 6, 8]


def test_holders_count_only_stages_of_exactly_a_span_of_the_cut():
    cut = cut_layers(6, 2)
    announced = [range(0, 3), range(0, 3), range(3, 6), range(0, 6), range(1, 3)]
    assert holders_per_span(cut, announced) == [2, 1]


def _brute_force(cut, holders, sizes, memory):
    best = None
    for i in range(len(cut)):
        if sizes[i] > memory:
            continue
        # no other fitting span has fewer holders, nor as few at a lower layer
        if all(not (sizes[j] <= memory and (holders[j], cut[j].start) < (holders[i], cut[i].start))
               for j in range(len(cut))):
            assert best is None
            best = cut[i]
    return best


def test_the_chooser_matches_brute_force_on_every_small_case():
    checked = 0
    for layers in range(1, 6):
        for count in range(1, layers + 1):
            cut = cut_layers(layers, count)
            for holders in itertools.product(range(3), repeat=count):
                for sizes in itertools.product((1, 2, 3), repeat=count):
                    for memory in (1, 2, 3):
                        want = _brute_force(cut, holders, sizes, memory)
                        if want is None:
                            with pytest.raises(MoeSwarmError, match="no stage span of this swarm fits"):
                                choose_span(cut, holders, sizes, memory)
                        else:
                            assert choose_span(cut, holders, sizes, memory) == want
                        checked += 1
    assert checked > 10000


def test_joiners_one_after_another_fill_the_spans_then_replicate_evenly():
    cut = cut_layers(12, 3)
    announced: list[range] = []
    for _ in range(7):
        announced.append(choose_span(cut, holders_per_span(cut, announced), [1] * 3, 1))
    assert announced == [cut[0], cut[1], cut[2], cut[0], cut[1], cut[2], cut[0]]


def test_memory_only_matters_when_a_span_does_not_fit():
    cut = cut_layers(6, 2)
    assert choose_span(cut, [0, 0], [5, 3], 4) == cut[1]  # the weakest would not fit: the next one
    with pytest.raises(MoeSwarmError) as raised:
        choose_span(cut, [0, 0], [5e9, 3e9], int(1e9))
    assert "the smallest, layers 3-5, takes 3 GB" in str(raised.value) and "\n" not in str(raised.value)
