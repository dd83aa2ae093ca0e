"""`Chain.add_replica`: a stage announced later joins its span's replicas after the one in use, by
round trip when the watch knows them (the fastest next to take over), last otherwise."""

from __future__ import annotations

from moeswarm.stages.client import Chain


def _chain() -> Chain:
    chain = Chain([["a:1", "b:1"], ["d:1"]], "f" * 16, hidden_size=8, num_layers=6, timeout_s=1.0)
    chain.spans = [range(0, 3), range(3, 6)]  # as connect() leaves them
    return chain


def test_a_faster_replica_goes_before_the_slower_ones_not_yet_used():
    chain = _chain()
    assert chain.add_replica(range(0, 3), "c:1", {"a:1": 1.0, "b:1": 30.0, "c:1": 5.0})
    assert chain.positions[0] == ["a:1", "c:1", "b:1"]  # a:1 in use stays first
    assert chain.add_replica(range(0, 3), "e:1", {"a:1": 1.0, "c:1": 5.0, "e:1": 0.5})
    assert chain.positions[0] == ["a:1", "e:1", "c:1", "b:1"]


def test_replicas_before_the_one_in_use_are_left_where_they_are():
    chain = _chain()
    chain._choice[0] = 1  # a:1 failed, b:1 in use
    assert chain.add_replica(range(0, 3), "c:1", {"a:1": 0.1, "b:1": 30.0, "c:1": 5.0})
    assert chain.positions[0] == ["a:1", "b:1", "c:1"] and chain.route == ["b:1", "d:1"]


def test_without_round_trips_or_with_unknown_ones_last():
    chain = _chain()
    assert chain.add_replica(range(3, 6), "x:1")
    assert chain.add_replica(range(0, 3), "y:1", {"b:1": 3.0})
    assert chain.positions == [["a:1", "b:1", "y:1"], ["d:1", "x:1"]]


def test_a_stage_listed_already_or_of_no_span_of_the_chain_is_not_added():
    chain = _chain()
    assert not chain.add_replica(range(0, 3), "b:1", {"b:1": 0.1})
    assert not chain.add_replica(range(0, 2), "z:1")
    assert chain.positions == [["a:1", "b:1"], ["d:1"]]
