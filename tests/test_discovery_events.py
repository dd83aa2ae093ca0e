"""Discovery emits plain join and leave events; the swarm applies them to its one dispatcher
through `change_members`; nothing patches a dispatcher after construction."""

from __future__ import annotations

import pytest
import torch
from test_dispatcher import E, FakeLink, _dispatcher, _routing, reference

from moeswarm.discovery.members import Joined, Left, Members
from moeswarm.discovery.record import Announcement, Capacity
from moeswarm.dispatch.membership import Change
from moeswarm.errors import WorkerError


def _record(address: str, held: dict[int, tuple[int, ...]]) -> Announcement:
    return Announcement(address, "fp", "fake", E, 16, held, False, Capacity(256, 16384), 0.0)


def test_members_emit_plain_events_and_count_cover_with_what_is_held_here():
    events = []
    members = Members(events.append, E, [0, 1], held_here={0: (0, 1, 2, 3), 1: (0, 1, 2, 3)})
    assert members.gaps() == {0: [4, 5, 6, 7], 1: [4, 5, 6, 7]}
    members.join(_record("w1:7730", {0: (4, 5, 6, 7), 1: (4, 5)}))
    assert events == [Joined("w1:7730", {0: (4, 5, 6, 7), 1: (4, 5)})]
    assert members.current() == {"w1:7730": {0: (4, 5, 6, 7), 1: (4, 5)}}
    assert members.gaps() == {1: [6, 7]}
    members.leave("w1:7730")
    members.leave("w1:7730")  # a second leave of the same address emits nothing
    assert events[1:] == [Left("w1:7730")] and members.current() == {}


def test_a_join_the_sink_refuses_leaves_nothing_joined():
    def refuse(event):
        raise WorkerError(event.address, "its HELLO announces other experts than its DHT record")

    members = Members(refuse, E, [0])
    with pytest.raises(WorkerError, match="other experts than its DHT record"):
        members.join(_record("w1:7730", {0: (0, 1)}))
    assert members.current() == {} and members.gaps() == {0: list(range(E))}


def test_a_change_applies_between_layer_calls_with_its_path_and_the_call_stays_exact():
    dispatcher, links = _dispatcher()
    paths = dispatcher.accounting.paths
    visitor = FakeLink("visitor", list(range(E)))
    dispatcher.change_members(Change.join(visitor, "relay"))
    assert [link.address for link in dispatcher.links] == ["a", "b"]  # queued, not applied yet
    hidden, index, weights = _routing(5, 3)
    assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)), reference(hidden, index, weights))
    assert [link.address for link in dispatcher.links] == ["a", "b", "visitor"]
    assert dispatcher.accounting.paths == {"visitor": "relay"} and paths == {}  # a new dict, the old one untouched
    dispatcher.change_members(Change.leave(links[0]))
    dispatcher.apply_membership()
    assert dispatcher.members() == [links[1], visitor] and not dispatcher.holders[0].usable
    assert torch.equal(dispatcher.combine(dispatcher.dispatch(1, hidden, index, weights)), reference(hidden, index, weights))
