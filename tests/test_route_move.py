"""`better_route`: a running gateway moves its chain only to a route clearly cheaper than the one in
use (by MOVE_FRACTION of its cost and MOVE_MS), a route costing its round trips plus CROSSING_MS a
stage. Hand cases: the margin's edges, ties, fewer stages, a faster replica, a stage not offered."""

from __future__ import annotations

from moeswarm.stages.route import CROSSING_MS, Offer, Position
from moeswarm.stages.route_move import MOVE_FRACTION, MOVE_MS, better_route, in_use_cost


def _offer(address: str, span: str, rtt_ms: float) -> Offer:
    first, last = map(int, span.split("-"))
    return Offer(address, range(first, last + 1), rtt_ms)


def _use(*pairs: tuple[str, str]) -> list[tuple[range, str]]:
    """(span "A-B", address) per position -> what better_route takes as the route in use."""
    return [(range(int(span.split("-")[0]), int(span.split("-")[1]) + 1), address) for span, address in pairs]


def test_the_weights_these_cases_are_written_for():
    assert (CROSSING_MS, MOVE_FRACTION, MOVE_MS) == (10.0, 0.2, 5.0)


def test_the_route_in_use_being_the_best_stays():
    offers = [_offer("a:1", "0-2", 1.0), _offer("b:1", "3-5", 1.0), _offer("c:1", "0-1", 30.0), _offer("d:1", "2-5", 1.0)]
    assert better_route(offers, 6, _use(("0-2", "a:1"), ("3-5", "b:1"))) is None


def test_a_route_of_as_many_stages_without_the_delay_is_taken():
    offers = [_offer("a:1", "0-2", 80.0), _offer("b:1", "3-5", 1.0), _offer("c:1", "0-1", 1.0), _offer("d:1", "2-5", 1.0)]
    route = better_route(offers, 6, _use(("0-2", "a:1"), ("3-5", "b:1")))  # 101 against 22
    assert route == [Position(range(0, 2), ("c:1",)), Position(range(2, 6), ("d:1",))]


def test_a_gain_under_the_fraction_stays_and_one_at_it_moves():
    in_use = _use(("0-2", "a:1"), ("3-5", "b:1"))
    slow = [_offer("a:1", "0-2", 40.0), _offer("b:1", "3-5", 40.0)]  # 100
    assert better_route(slow + [_offer("c:1", "0-1", 32.0), _offer("d:1", "2-5", 32.0)], 6, in_use) is None  # 84
    moved = better_route(slow + [_offer("c:1", "0-1", 30.0), _offer("d:1", "2-5", 30.0)], 6, in_use)  # 80: 20 %
    assert [p.replicas[0] for p in moved] == ["c:1", "d:1"]


def test_a_gain_over_the_fraction_but_under_the_ms_stays():
    offers = [_offer("a:1", "0-5", 4.0), _offer("b:1", "0-5", 0.5)]  # 14 against 10.5: 25 %, 3.5 ms
    assert better_route(offers, 6, _use(("0-5", "a:1"))) is None
    offers = [_offer("a:1", "0-5", 16.0), _offer("b:1", "0-5", 10.5)]  # 26 against 20.5: 21 %, 5.5 ms
    assert better_route(offers, 6, _use(("0-5", "a:1"))) == [Position(range(0, 6), ("b:1", "a:1"))]


def test_a_faster_replica_of_the_span_in_use_is_moved_to_first():
    offers = [_offer("a:1", "0-5", 60.0), _offer("b:1", "0-5", 1.0)]
    assert better_route(offers, 6, _use(("0-5", "a:1"))) == [Position(range(0, 6), ("b:1", "a:1"))]


def test_a_tie_stays_whichever_route_is_in_use():
    offers = [_offer("a:1", "0-2", 3.0), _offer("b:1", "3-5", 3.0), _offer("c:1", "0-1", 3.0), _offer("d:1", "2-5", 3.0)]
    assert better_route(offers, 6, _use(("0-2", "a:1"), ("3-5", "b:1"))) is None
    assert better_route(offers, 6, _use(("0-1", "c:1"), ("2-5", "d:1"))) is None


def test_fewer_stages_on_loopback_are_a_clear_gain():
    offers = [_offer("a:1", "0-2", 0.2), _offer("b:1", "3-5", 0.2), _offer("w:1", "0-5", 0.3)]  # 20.4 against 10.3
    assert better_route(offers, 6, _use(("0-2", "a:1"), ("3-5", "b:1"))) == [Position(range(0, 6), ("w:1",))]


def test_a_stage_in_use_not_offered_counts_no_round_trip():
    in_use = _use(("0-2", "gone:1"), ("3-5", "b:1"))
    assert in_use_cost([_offer("b:1", "3-5", 2.0)], in_use) == 22.0
    offers = [_offer("b:1", "3-5", 2.0), _offer("c:1", "0-2", 4.0)]  # 22 against 26: the unknown one stays
    assert better_route(offers, 6, in_use) is None


def test_no_tiling_stays():
    assert better_route([_offer("a:1", "0-2", 1.0)], 6, _use(("0-2", "a:1"), ("3-5", "b:1"))) is None
