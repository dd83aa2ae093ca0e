"""A stage member's move in order (node/stage_member.py), over stand-in nodes: the new span's
node is opened and announced before the old one is withdrawn, and closed only after its drain;
the first read and a one-read hole move nobody; a thin span (3 + 1) moves the smallest address of
the crowded one, its line saying how many hold both; a failed move leaves the old node serving."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from moeswarm.node.stage_member import StageMember
from moeswarm.placement.stage_cut import cut_layers

CUT = cut_layers(6, 2)


class FakeNode:
    def __init__(self, span: range, address: str, events: list, fail: bool = False):
        self.options = SimpleNamespace(span=span)
        self.address, self.events, self.fail = address, events, fail
        self.announcer = None
        self.dht = "dht"
        self.steps = 0

    def start(self):
        if self.fail:
            raise OSError("port taken")
        self.announcer = SimpleNamespace(record=SimpleNamespace(address=self.address))
        self.events.append(("announced", self.address))

    def withdraw(self):
        self.events.append(("withdrawn", self.address))

    def close(self):
        self.events.append(("closed", self.address, self.dht))


def _member(events, records, fail=False):
    node = FakeNode(CUT[0], "a:1", events)
    node.start()

    def open_node(span):
        events.append(("fetched", span))
        return FakeNode(span, "a:2", events, fail)

    return StageMember(node, CUT, open_node, lambda: dict(records), events.append,
                       on_move=lambda old: events.append(("on_move", old)), grace_s=0.01, poll_s=0.01)


def test_the_move_announces_first_and_closes_last():
    events: list = []
    records = {"a:1": CUT[0], "b:1": CUT[0]}  # 3-5 held by nobody
    member = _member(events, records)
    assert member.step() is None  # the first read: nobody moves yet
    assert not any(isinstance(e, tuple) and e[0] == "fetched" for e in events)
    assert member.step(threading.Event()) == CUT[1]
    order = [e for e in events if isinstance(e, tuple)]
    assert order == [("announced", "a:1"), ("fetched", CUT[1]), ("announced", "a:2"), ("withdrawn", "a:1"),
                     ("closed", "a:1", None), ("on_move", CUT[0])]  # the old node left the DHT to the new one
    assert member.span == CUT[1] and member.moves == 1
    assert any("moving there from layers 0-2 (held by 2)" in e for e in events if isinstance(e, str))


def test_the_larger_address_stays_and_a_failed_move_keeps_the_old_node():
    events: list = []
    member = _member(events, {"0:1": CUT[0], "a:1": CUT[0]})  # "0:1" < "a:1": the other one moves
    assert member.step() is None and member.step() is None and member.moves == 0

    events = []
    member = _member(events, {"a:1": CUT[0], "b:1": CUT[0]}, fail=True)
    member.step()
    with pytest.raises(OSError, match="port taken"):  # serve() reports it and tries again next round
        member.step()
    assert member.span == CUT[0] and member.moves == 0
    assert ("closed", "a:2", None) in events and ("withdrawn", "a:1") not in events  # the new one closed, not the DHT


def test_a_thin_span_takes_a_holder_once_it_was_as_thin_at_the_read_before():
    events: list = []
    records = {"a:1": CUT[0], "b:1": CUT[0], "c:1": CUT[0], "d:1": CUT[1], "e:1": CUT[1]}
    member = _member(events, records)
    assert member.step() is None  # 3 + 2: a move would not even it
    del records["e:1"]  # 3-5 lost a holder at this read only (a late refresh, or a departure)
    assert member.step() is None
    assert member.step(threading.Event()) == CUT[1]  # as thin again: "a:1" < "b:1" < "c:1" moves
    assert member.span == CUT[1] and member.moves == 1
    lines = [e for e in events if isinstance(e, str)]
    assert lines[0] == "rebalancing: layers 3-5 have 1 stage; moving there from layers 0-2 (held by 3)"


def test_a_thin_span_that_does_not_fit_is_reported_and_left():
    events: list = []
    member = _member(events, {"a:1": CUT[0], "b:1": CUT[0], "c:1": CUT[0], "d:1": CUT[1]})
    member.fits = lambda span: span == CUT[0]
    assert member.step() is None and member.step() is None and member.moves == 0
    assert [e for e in events if isinstance(e, str)] == [
        "rebalancing: layers 3-5 have 1 stage but do not fit this member's memory: staying"]
