"""The joiner's share (placement/share.py) against brute force over every subset, on small swarms."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from moeswarm.errors import MoeSwarmError
from moeswarm.placement.share import choose_share, coverage_of, experts_for_memory, gain, joiner_order


def _worth(coverage, experts, load) -> tuple[int, Fraction]:
    """A share's worth computed from scratch: cells covered, then load per holder removed."""
    covers, relief = 0, Fraction(0)
    for layer, holders in coverage.items():
        for expert in experts:
            h = holders[expert]
            weight = 1 if load is None else load[layer][expert]
            if h == 0:
                covers += 1
            else:
                relief += Fraction(weight, h) - Fraction(weight, h + 1)
    return covers, relief


@pytest.mark.parametrize("seed", range(60))
def test_the_share_is_as_good_as_the_best_subset(seed):
    rng = random.Random(seed)
    num_experts, layers = rng.randint(1, 7), rng.randint(1, 3)
    coverage = {layer: [rng.choice((0, 0, 1, 2, 3)) for _ in range(num_experts)] for layer in range(layers)}
    load = None if seed % 3 == 0 else {layer: [rng.randint(0, 9) for _ in range(num_experts)] for layer in coverage}
    count = rng.randint(1, num_experts)
    order = joiner_order(bytes([seed]), num_experts)
    share = choose_share(coverage, count, load, order)
    best = max(_worth(coverage, subset, load) for subset in itertools.combinations(range(num_experts), count))
    assert len(share.experts) == count and list(share.experts) == sorted(set(share.experts))
    assert (share.covers, share.relief) == _worth(coverage, share.experts, load) == best


def test_an_empty_swarm_is_split_by_successive_joiners():
    coverage = coverage_of([], [0, 1], 8)
    first = choose_share(coverage, 4)
    assert first.experts == (0, 1, 2, 3) and first.covers == 8
    second = choose_share(coverage_of([{0: first.experts, 1: first.experts}], [0, 1], 8), 4)
    assert second.experts == (4, 5, 6, 7) and second.covers == 8
    both = coverage_of([{0: first.experts, 1: first.experts}, {0: second.experts, 1: second.experts}], [0, 1], 8)
    third = choose_share(both, 2, load={0: [9, 1, 1, 1, 1, 1, 1, 5], 1: [1] * 8})
    assert third.experts == (0, 7) and third.covers == 0  # the hottest experts get a second holder


def test_a_hole_left_by_a_member_comes_before_any_load():
    coverage = {0: [1, 1, 0, 1], 1: [1, 1, 1, 1]}
    assert choose_share(coverage, 1, load={0: [100, 100, 0, 100], 1: [100] * 4}).experts == (2,)
    assert gain(coverage, 2) == (1, Fraction(1, 2))


def test_coverage_ignores_other_layers_and_counts_each_member_once():
    assert coverage_of([{0: (0, 0, 1), 5: (1,)}, {0: (1,), 9: (3,)}], [0, 5], 4) == {0: [1, 2, 0, 0], 5: [0, 1, 0, 0]}


def test_ties_follow_the_joiners_own_order():
    coverage = {0: [0] * 6}
    assert choose_share(coverage, 2, order=[5, 3, 0, 1, 2, 4]).experts == (3, 5)
    orders = {tuple(joiner_order(bytes([i]), 16)) for i in range(8)}
    assert len(orders) == 8 and all(sorted(o) == list(range(16)) for o in orders)


def test_memory_sizes_the_share():
    assert experts_for_memory(10_000, 3_000, 8) == 3
    assert experts_for_memory(10**12, 3_000, 8) == 8
    with pytest.raises(MoeSwarmError, match="one expert of this model takes 3000 bytes"):
        experts_for_memory(2_999, 3_000, 8)
    with pytest.raises(MoeSwarmError, match="1 to 4 experts"):
        choose_share({0: [0] * 4}, 5)
