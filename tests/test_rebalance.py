"""A member's rebalancing move (placement/rebalance.py) against brute force over every reachable share,
and whole swarms rebalanced round by round: one mover a round, nothing ever uncovered, rounds end."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from fractions import Fraction
from types import SimpleNamespace

import pytest

from moeswarm.node.rebalancing import DRAIN_MAX_GRACES, Member, Settling, plan_round
from moeswarm.placement.rebalance import SWARM_MARGIN, choose_mover, cost, droppable, rebalance, without
from moeswarm.placement.share import coverage_of


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


def _covered(coverage) -> set[tuple[int, int]]:
    return {(layer, e) for layer, holders in coverage.items() for e, h in enumerate(holders) if h}


def _random_swarm(rng: random.Random):
    num_experts, layers = rng.randint(2, 7), rng.randint(1, 3)
    members = {f"m{i}": tuple(sorted(rng.sample(range(num_experts), rng.randint(1, num_experts))))
               for i in range(rng.randint(1, 4))}
    extra = [{layer: rng.sample(range(num_experts), rng.randint(0, 2)) for layer in range(layers)}]  # a per-layer holder
    helds = [{layer: share for layer in range(layers)} for share in members.values()] + extra
    load = None if rng.random() < 0.4 else {layer: [rng.randint(0, 9) for _ in range(num_experts)]
                                            for layer in range(layers)}
    return coverage_of(helds, list(range(layers)), num_experts), members, load


@pytest.mark.parametrize("seed", range(80))
def test_the_move_is_as_good_as_the_best_reachable_share(seed):
    rng = random.Random(seed)
    coverage, members, load = _random_swarm(rng)
    share = next(iter(members.values()))
    num_experts = len(coverage[0])
    capacity = rng.randint(len(share), num_experts)
    max_swaps = None if seed % 2 else rng.randint(0, 3)
    move = rebalance(coverage, share, capacity, load, margin=Fraction(0), max_swaps=max_swaps)
    others = without(coverage, share)
    keep = set(share) - set(droppable(coverage, share))
    swaps = len(share) if max_swaps is None else max_swaps
    reachable = [set(s) for n in range(len(share), capacity + 1) for s in itertools.combinations(range(num_experts), n)
                 if keep <= set(s) and len(set(share) - set(s)) <= swaps]
    best = max(_worth(others, s, load) for s in reachable)
    now = _worth(others, share, load)
    if move is None:
        assert best == now  # nothing reachable gains
        return
    after = set(move.share)
    assert after in reachable and _worth(others, after, load) == best > now
    assert set(move.fetch) == after - set(share) and set(move.drop) == set(share) - after
    assert move.gain == tuple(b - n for b, n in zip(best, now))
    moved = coverage_of([{layer: after for layer in coverage}], list(coverage), num_experts)
    assert _covered(coverage) <= _covered({l: [a + b for a, b in zip(others[l], moved[l])] for l in coverage})


@pytest.mark.parametrize("seed", range(40))
def test_a_swarm_settles_one_mover_a_round_and_never_uncovers(seed):
    rng = random.Random(1000 + seed)
    coverage, members, load = _random_swarm(rng)
    layers, num_experts = list(coverage), len(coverage[0])
    extra = {layer: [h - sum(e in s for s in members.values()) for e, h in enumerate(coverage[layer])]
             for layer in layers}  # the per-layer holder's cells, which never move
    for _ in range(200):
        covered = _covered(coverage)
        chosen = choose_mover(coverage, members, load=load)
        if chosen is None:
            break
        mover, move = chosen
        for member in members:  # the mover's move gains most; ties go to the smallest id
            other = rebalance(coverage, members[member], len(members[member]), load)
            if other is not None and member != mover:
                assert other.gain <= move.gain and (other.gain != move.gain or mover < member)
        assert len(move.share) == len(members[mover])
        members = {**members, mover: move.share}
        helds = [{layer: s for layer in layers} for s in members.values()]
        coverage = {l: [a + b for a, b in zip(coverage_of(helds, layers, num_experts)[l], extra[l])] for l in layers}
        assert covered <= _covered(coverage)  # fetch first, drop after: nothing held before is lost
    else:
        pytest.fail("rebalancing did not settle in 200 rounds")
    total = sum(len(s) for s in members.values())
    if total >= num_experts:  # enough room: no expert is left without a holder
        assert all(h for holders in coverage.values() for h in holders)


def test_a_member_that_left_is_replaced_by_one_move_of_the_best_placed_member():
    # three members of 4 experts over 8; "a" leaves: its experts 0-3 lose their only holder where c does not hold them
    b, c = (4, 5, 6, 7), (0, 1, 4, 5)
    coverage = coverage_of([{0: b, 1: b}, {0: c, 1: c}], [0, 1], 8)
    mover, move = choose_mover(coverage, {"b": b, "c": c})
    assert mover == "b" and move.fetch == (2, 3) and move.drop == (4, 5) and move.gain[0] == 4
    assert move.share == (2, 3, 6, 7)
    after = coverage_of([{0: move.share, 1: move.share}, {0: c, 1: c}], [0, 1], 8)
    assert all(after[layer] == [1] * 8 for layer in after) and choose_mover(after, {"b": move.share, "c": c}) is None


def test_the_margin_damps_small_gains_and_the_sole_holder_never_drops():
    coverage = {0: [2, 2, 1, 1]}  # m holds 0 and 1, someone else 0-3
    assert rebalance(coverage, (0, 1), 2) is None  # moving to 2 or 3 only evens the load: 1/2 vs 1/2
    assert rebalance({0: [2, 2, 1, 1]}, (0, 1), 2, load={0: [1, 1, 1, 1]}) is None
    assert rebalance({0: [2, 2, 1, 1]}, (0, 1), 2, load={0: [1, 1, 2, 1]}).drop == (0,)  # 2/2 > 1.25 x 1/2
    assert rebalance({0: [2, 2, 1, 1]}, (0, 1), 2, load={0: [4, 4, 5, 1]}) is None  # 5/2 < 1.25 x 4/2
    assert rebalance({0: [1, 1, 0, 0]}, (0, 1), 2) is None and droppable({0: [1, 1, 0, 0]}, (0, 1)) == []
    assert rebalance({0: [1, 1, 1, 1]}, (0,), 3).fetch == (1, 2)  # free room is filled before anything is swapped


def _spare(loads):
    """m and o hold 0-3, n holds 4-7, p all 8 (0-3 three times, 4-7 twice, one layer), with `loads` measured."""
    shares = {"m": (0, 1, 2, 3), "n": (4, 5, 6, 7), "o": (0, 1, 2, 3)}
    coverage = coverage_of([{0: share} for share in shares.values()] + [{0: tuple(range(8))}], [0], 8)
    return coverage, shares, {0: loads}


def test_the_swarm_gains_by_a_margin_or_nothing_moves():
    # noise: expert 3 measured at 2 rows/min, the others at 10: m's swap of 3 for 4 passes the per-swap
    # margin (10/6 > 1.25 x 2/6) but lowers the swarm's load per holder by 4/3 of 92/3, under a tenth
    coverage, shares, load = _spare([10, 10, 10, 2, 10, 10, 10, 10])
    assert rebalance(coverage, shares["m"], 4, load) is not None
    assert cost(coverage, load) == Fraction(92, 3) and choose_mover(coverage, shares, load=load) is None
    assert choose_mover(coverage, shares, load=load, swarm_margin=Fraction(0))[0] == "m"  # the rule that moved it
    # a real imbalance: 0-3 never routed; m takes 4-7 and the swarm's 80 falls by 4 x 40/6, over a tenth
    coverage, shares, load = _spare([0, 0, 0, 0, 40, 40, 40, 40])
    mover, move = choose_mover(coverage, shares, load=load)
    assert mover == "m" and move.share == (4, 5, 6, 7) and move.gain[2] >= SWARM_MARGIN * cost(coverage, load)
    # a hole always moves, however small the swarm's load there
    b, c = (4, 5, 6, 7), (0, 1, 4, 5)
    coverage = coverage_of([{0: b}, {0: c}], [0], 8)
    assert choose_mover(coverage, {"b": b, "c": c}, load={0: [1000] * 8})[1].gain[0] == 2


def test_no_load_takes_a_second_holder_away_and_a_cell_held_once_draws_one():
    """Every expert held twice (m 0-3, n 4-7, p all): however hot 4-7 are measured, nobody drops a
    second holder of 0-3 for them (a member leaving would then take 0-3's only copy). With 0-3
    held once (p gone), a member with room takes 0-3 over the hot 4-7."""
    shares = {"m": (0, 1, 2, 3), "n": (4, 5, 6, 7)}
    load = {0: [0, 0, 0, 0, 40, 40, 40, 40]}
    twice = coverage_of([{0: share} for share in shares.values()] + [{0: tuple(range(8))}], [0], 8)
    assert choose_mover(twice, shares, load=load, swarm_margin=Fraction(0)) is None
    once = coverage_of([{0: share} for share in shares.values()] + [{0: (4, 5, 6, 7)}], [0], 8)
    mover, move = choose_mover(once, shares, capacities={"n": 8}, load=load)
    assert mover == "n" and move.fetch == (0, 1, 2, 3) and move.gain[:2] == (0, 4)


def test_loads_weigh_a_round_only_once_the_swarm_kept_its_members_and_shares():
    now = [0.0]
    settling = Settling(10.0, clock=lambda: now[0])
    records = {"a:1": ({0: (0, 1)}, None), "b:1": ({0: (2, 3)}, None)}
    assert not settling.settled(records)  # the first round starts the wait
    now[0] = 9.9
    assert not settling.settled(dict(records))
    now[0] = 10.0
    assert settling.settled(dict(records))
    loaded = {address: (held, {0: (5, 5)}) for address, (held, _) in records.items()}
    assert settling.settled(loaded)  # new rates are not a change of the swarm
    moved = {**records, "b:1": ({0: (1, 3)}, None)}
    assert not settling.settled(moved)  # a move starts the wait again
    now[0] = 20.0
    assert settling.settled(moved)
    assert not settling.settled({"a:1": records["a:1"]})  # so does a leave


def test_a_round_before_the_swarm_settled_weighs_every_pair_alike():
    # m, o and p hold 0-3, n and p 4-7; the loads say 0-3 are never routed: with loads m moves to 4-7,
    # without them m's 0-3 and 4-7 would each have 2 holders besides it, and nothing moves
    records = {"m:1": ({0: (0, 1, 2, 3)}, {0: (0, 0, 0, 0)}), "n:1": ({0: (4, 5, 6, 7)}, {0: (40, 40, 40, 40)}),
               "o:1": ({0: (0, 1, 2, 3)}, None), "p:1": ({0: tuple(range(8))}, None)}
    move = plan_round(records, "m:1", (0, 1, 2, 3), [0], 8, loads=True)
    assert move is not None and move.share == (4, 5, 6, 7)
    assert plan_round(records, "m:1", (0, 1, 2, 3), [0], 8, loads=False) is None


class _Served:
    """Rows a node's experts computed: one more at each look until `busy_s` from now."""

    def __init__(self, busy_s: float):
        self.until, self.rows = time.monotonic() + busy_s, 0

    def totals(self) -> dict[int, tuple[int, ...]]:
        self.rows += time.monotonic() < self.until
        return {0: (self.rows,)}


def _drained_after(busy_s: float, said: list[str]) -> float:
    """Seconds a moved member keeps its withdrawn node (grace 0.1 s, looks every 0.02 s) that is
    routed to for `busy_s`."""
    member = Member(None, (0,), [0], 1, None, None, report=said.append, grace_s=0.1, poll_s=0.02)
    old = SimpleNamespace(server=SimpleNamespace(store=SimpleNamespace(served=_Served(busy_s))))
    started = time.monotonic()
    asyncio.run(member._drain(old, None))
    return time.monotonic() - started


def test_a_withdrawn_node_answers_until_backbones_stop_routing_to_it():
    said = []
    assert 0.1 <= _drained_after(0.0, said) < 0.6  # idle: closed after the grace and QUIET_POLLS quiet looks
    assert 0.4 <= _drained_after(0.4, said) < 1.0  # routed to past the grace: kept until it went quiet
    assert not said
    assert 0.9 <= _drained_after(60.0, said) < 2.0  # routed to for ever: DRAIN_MAX_GRACES graces, said
    assert said == [f"closing the old share's node: still routed to after {DRAIN_MAX_GRACES * 0.1:g} s"]
