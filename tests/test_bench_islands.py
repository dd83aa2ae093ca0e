"""`moeswarm bench islands`' bookkeeping: each chain of islands beside the layer split of the same
spans, and issue 25's targets, from rows (the runs themselves need the real-dimension file)."""

from __future__ import annotations

import pytest

from moeswarm_bench.bench.islands import Row, _against_split, _targets
from moeswarm_bench.bench.islands_bench import table_lines


def _row(topology, rtt, speculate, ms):
    return Row(topology, rtt, speculate, ms, 1.0, 0, 0.1, True)


ROWS = [_row("local", 0, 0, 50.0), _row("star", 50, 0, 900.0),
        _row("2 stages", 50, 0, 200.0), _row("2 stages", 50, 4, 120.0), _row("2 stages", 20, 0, 110.0),
        _row("2-way split", 50, 0, 160.0), _row("2-way split", 50, 4, 100.0),
        _row("4 stages", 50, 0, 260.0), _row("1-way split", 50, 0, 150.0)]


def test_each_chain_of_islands_meets_the_split_of_its_own_spans_rtt_and_drafts():
    pairs = {(p["islands"], p["rtt_ms"], p["speculate"]): p for p in _against_split(ROWS)}
    assert set(pairs) == {("2 stages", 50, 0), ("2 stages", 50, 4)}  # no 2-way split at 20 ms, no 4-way split
    assert pairs[("2 stages", 50, 0)]["split_ms"] == 160.0
    assert pairs[("2 stages", 50, 0)]["ratio"] == pytest.approx(1.25)
    assert pairs[("2 stages", 50, 4)]["ratio"] == pytest.approx(1.2)


def test_targets_and_the_printed_lines():
    targets = _targets(ROWS)
    assert [t["met"] for t in targets] == [True, False]  # 200 <= 0.25 x 900; 200 > 75 + 65
    assert targets[1]["measured"] == 200.0
    lines = table_lines({"rows": [vars(r) for r in ROWS], "targets": targets, "against_split": _against_split(ROWS)})
    assert "   2 stages rtt    50 ms drafts 0: 1.25x the layer split's per-token time (200 against 160 ms)" in lines
