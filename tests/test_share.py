"""The joiner's share (placement/share.py) against brute force over every subset, on small swarms,
weighed by the loads members announce (placement/load.py)."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from moeswarm.discovery.joining import plan_share
from moeswarm.errors import MoeSwarmError
from moeswarm.placement.load import swarm_load
from moeswarm.placement.share import choose_share, coverage_of, experts_for_memory, gain, joiner_order


def _worth(coverage, experts, load) -> tuple[int, int, Fraction]:
    """A share's worth against `coverage` from scratch: cells it covers, cells it gives a second holder,
    then load per holder removed."""
    covers, backs, relief = 0, 0, Fraction(0)
    for layer, holders in coverage.items():
        for expert in experts:
            h = holders[expert]
            weight = 1 if load is None else load[layer][expert]
            if h == 0:
                covers += 1
            else:
                backs += h == 1
                relief += Fraction(weight, h) - Fraction(weight, h + 1)
    return covers, backs, relief


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
    assert (share.covers, share.backs, share.relief) == _worth(coverage, share.experts, load) == best


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
    assert gain(coverage, 2) == (1, 1, Fraction(1, 2))  # covers layer 0, backs layer 1


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


def _members(rng: random.Random, num_experts: int, layers: int) -> list:
    """Random members: (held {layer: experts}, load aligned with held, or None: an old record)."""
    members = []
    for _ in range(rng.randint(0, 4)):
        held = {layer: tuple(sorted(rng.sample(range(num_experts), rng.randint(1, num_experts))))
                for layer in range(layers)}
        load = None if rng.random() < 0.3 else {layer: tuple(rng.randint(0, 60) for _ in experts)
                                                for layer, experts in held.items()}
        members.append((held, load))
    return members


@pytest.mark.parametrize("seed", range(40))
def test_the_share_weighed_by_announced_loads_is_as_good_as_the_best_subset(seed):
    """The loads members announce (placement/load.py), then the share: brute force agrees."""
    rng = random.Random(1000 + seed)
    num_experts, layers = rng.randint(1, 7), rng.randint(1, 3)
    members = _members(rng, num_experts, layers)
    coverage = coverage_of((held for held, _ in members), range(layers), num_experts)
    load = swarm_load(members, range(layers), num_experts)
    count = rng.randint(1, num_experts)
    share = choose_share(coverage, count, load, joiner_order(bytes([seed]), num_experts))
    best = max(_worth(coverage, subset, load) for subset in itertools.combinations(range(num_experts), count))
    assert (share.covers, share.backs, share.relief) == _worth(coverage, share.experts, load) == best


def test_the_swarm_load_sums_holders_scales_the_unmeasured_and_fills_the_unknown():
    a = ({0: (0, 1), 1: (0,)}, {0: (30, 6), 1: (12,)})
    b = ({0: (1, 2)}, {0: (4, 0)})
    old = ({0: (2,), 1: (1,)}, None)  # a record without a load
    load = swarm_load([a, b, old], [0, 1], 4)
    # (0,2): b says 0, old says nothing: 0 * 2 / 1; (1,1) and (0,3), (1,2), (1,3): nobody measures: the mean
    mean = round((30 + 10 + 0 + 12) / 4)
    assert load == {0: [30, 10, 0, mean], 1: [12, mean, mean, mean]}
    assert swarm_load([old], [0, 1], 4) is None  # nothing measured: every pair weighs 1
    assert swarm_load([b], [0], 4) == {0: [2, 4, 0, 2]}  # the unheld: the mean of 4 and 0
    assert swarm_load([({0: (0,)}, {0: (0,)})], [0], 2) is None  # an idle swarm: every pair weighs 1
    assert swarm_load([({0: (0, 1)}, {0: (5,)})], [0], 2) is None  # rates not matching the experts: ignored


class _Manifest:
    """What plan_share reads of a manifest: each expert's bytes over every MoE layer."""

    def expert_bytes(self) -> int:
        return 1000


def test_a_hot_expert_attracts_the_joiners_share():
    """Every expert held once; the holder of 0-3 measures expert 2 hot: a joiner with room for two
    experts takes 2 whatever its own order; with old records (no load) it takes its order's first two."""
    cold = [(dict.fromkeys((0, 1), (0, 1, 2, 3)), None), (dict.fromkeys((0, 1), (4, 5, 6, 7)), None)]
    hot = [(cold[0][0], {0: (10, 10, 900, 10), 1: (10, 10, 700, 10)}),
           (cold[1][0], {0: (10,) * 4, 1: (10,) * 4})]
    for seed in range(8):
        order = joiner_order(bytes([seed]), 8)
        assert plan_share(_Manifest(), [0, 1], 8, cold, 2000, bytes([seed])).experts == tuple(sorted(order[:2]))
        share = plan_share(_Manifest(), [0, 1], 8, hot, 2000, bytes([seed]))
        assert 2 in share.experts and share.covers == 0


def test_a_member_moves_toward_a_hot_expert_when_rebalancing():
    """Two members hold 0-3 twice over, one holds 4-7 alone; expert 5 is measured hot: the best placed
    of the two doubled members swaps one of its experts for 5 (placement/rebalance.py, node/rebalancing.py)."""
    from moeswarm.node.rebalancing import plan_round

    layers = [0, 1]
    records = {"a:1": (dict.fromkeys(layers, (0, 1, 2, 3)), dict.fromkeys(layers, (5, 5, 5, 5))),
               "b:1": (dict.fromkeys(layers, (0, 1, 2, 3)), dict.fromkeys(layers, (5, 5, 5, 5))),
               "c:1": (dict.fromkeys(layers, (4, 5, 6, 7)), dict.fromkeys(layers, (10, 2000, 10, 10)))}
    moves = {me: plan_round(records, me, records[me][0][0], layers, 8) for me in records}
    assert moves["b:1"] is None and moves["c:1"] is None  # one mover a round: the smallest address
    assert moves["a:1"].fetch == (5,) and len(moves["a:1"].drop) == 1
    flat = {me: (held, None) for me, (held, _) in records.items()}  # old records: nothing is hot
    assert all(plan_round(flat, me, flat[me][0][0], layers, 8) is None for me in flat)
