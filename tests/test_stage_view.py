"""The stages part of `moeswarm status` and of the `/swarm` page, by hand: every stage with its span,
the version and uptime its record says, round trip and whether the route uses it; the coverage
per span with the weakest marked, a span of the cut nobody holds included; the route, or why
there is none."""

from __future__ import annotations

from types import SimpleNamespace

from moeswarm.discovery.stage_record import StageRecord
from moeswarm.discovery.stage_view import SpanRow, StageRow, format_stages, span_rows, stage_json, stage_rows
from moeswarm.stages.route import Offer


def test_stage_rows_in_layer_order_the_ones_in_use_marked():
    rows = stage_rows([("b:2", range(3, 6), 4.0, "", None), ("a:1", range(0, 3), 1.5, "", None),
                       ("c:3", range(3, 6), None, "cannot be reached: refused", None), ("a2:1", range(0, 3), 9.0, "", None)],
                      [(range(0, 3), "a:1"), (range(3, 6), "b:2")])
    assert rows == [StageRow("a2:1", range(0, 3), 9.0, False), StageRow("a:1", range(0, 3), 1.5, True),
                    StageRow("b:2", range(3, 6), 4.0, True),
                    StageRow("c:3", range(3, 6), None, False, "cannot be reached: refused")]


def test_a_stage_of_the_same_address_but_another_span_is_not_in_use():
    (row,) = stage_rows([("a:1", range(0, 2), 1.0, "", None)], [(range(0, 3), "a:1")])
    assert not row.in_route


def test_span_rows_count_each_address_once_and_mark_the_fewest():
    spans = span_rows([("a:1", range(0, 3)), ("a:1", range(0, 3)), ("a2:1", range(0, 3)), ("b:2", range(3, 6)),
                       ("w:9", range(0, 6))])
    assert spans == [SpanRow(range(0, 3), 2, False), SpanRow(range(0, 6), 1, True), SpanRow(range(3, 6), 1, True)]


def test_a_span_of_the_cut_nobody_holds_is_the_weakest():
    spans = span_rows([("a:1", range(0, 3))], cut=[range(0, 3), range(3, 6)])
    assert spans == [SpanRow(range(0, 3), 1, False), SpanRow(range(3, 6), 0, True)]
    assert span_rows([]) == []


def test_a_stage_row_shows_the_version_and_uptime_its_record_says():
    """From a StageRecord (`status`), an Offer read from one (the `/swarm` page) or nothing (a stage
    of the chain's own, not offered; a record of an older moeswarm): None where nothing is said,
    an uptime never below 0 whatever the stage's clock."""
    now = 1_800_000_090.5
    record = StageRecord("a:1", "f" * 16, "qwen2_moe", range(0, 3), 16, tls=False, version="0.1.0",
                         started=1_800_000_000.0)
    offer = Offer("b:2", range(3, 6), 2.0, "0.2.0", 1_800_000_030.5)
    ahead = Offer("c:3", range(3, 6), 3.0, "0.1.0", now + 50)
    rows = stage_rows([("a:1", range(0, 3), 1.5, "", record), ("b:2", range(3, 6), 2.0, "", offer),
                       ("c:3", range(3, 6), 3.0, "", ahead), ("d:4", range(3, 6), None, "", None),
                       ("e:5", range(3, 6), None, "", StageRecord("e:5", "f" * 16, "qwen2_moe", range(3, 6), 16, False))],
                      [], now)
    assert [(r.address, r.version, r.uptime_s) for r in rows] == [
        ("a:1", "0.1.0", 90.5), ("b:2", "0.2.0", 60.0), ("c:3", "0.1.0", 0.0), ("d:4", None, None), ("e:5", None, None)]
    (escaped,) = stage_rows([("a:1", range(0, 3), 1.5, "", SimpleNamespace(version="\x1b[31m0.1", started=None))], [])
    assert "\x1b" not in escaped.version


def test_the_json_and_the_lines():
    record = SimpleNamespace(version="0.1.0", started=1_800_000_000.0)
    rows = stage_rows([("a:1", range(0, 3), 1.5, "", record), ("b:2", range(3, 6), None, "refused", None)],
                      [(range(0, 3), "a:1")], 1_800_018_300.0)  # 5 h 5 min after a:1 started
    spans = span_rows([("a:1", range(0, 3)), ("b:2", range(3, 6))], cut=[range(0, 3), range(3, 6)])
    assert stage_json(rows, spans, [(range(0, 3), "a:1")]) == {
        "stages": [{"address": "a:1", "layers": [0, 2], "rtt_ms": 1.5, "in_route": True, "cause": "",
                    "version": "0.1.0", "uptime_s": 18300.0},
                   {"address": "b:2", "layers": [3, 5], "rtt_ms": None, "in_route": False, "cause": "refused",
                    "version": None, "uptime_s": None}],
        "spans": [{"layers": [0, 2], "stages": 1, "weakest": True}, {"layers": [3, 5], "stages": 1, "weakest": True}],
        "route": [{"layers": [0, 2], "address": "a:1"}]}
    assert format_stages(rows, spans, [(range(0, 3), "a:1"), (range(3, 6), "b:2")], "route from here") == [
        "2 stages announced:",
        "  ADDRESS  LAYERS   VERSION          UP   RTT MS  ROUTE",
        "  a:1      0-2      0.1.0          5h5m     1.50  in use",
        "  b:2      3-5      -                 -        -  unusable: refused",
        "coverage per span (stages holding exactly it):",
        "  layers 0-2      1 stage  <- weakest",
        "  layers 3-5      1 stage  <- weakest",
        "route from here: layers 0-2 at a:1, layers 3-5 at b:2"]
    assert format_stages([], [], [], "route from here", "no stage holds decoder layers 0-5")[-1] == \
        "route from here: none (no stage holds decoder layers 0-5)"


def test_an_address_with_a_terminal_escape_is_printed_escaped():
    (row,) = stage_rows([("\x1b[31mevil:1", range(0, 1), None, "refused \x1b[0m", None)], [])
    assert "\x1b" not in row.address and "\x1b" not in row.cause
