"""Smoke test of `moeswarm bench wan --quick`: every scenario runs and its rows are well formed.

No timing assertions: the figures depend on the machine; only structure and sanity are checked.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moeswarm.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def wan_result(tmp_path_factory) -> dict:
    model = make_tiny_model("qwen2_moe", tmp_path_factory.mktemp("wan") / "qwen2_moe", num_hidden_layers=2)
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "wan", "--quick", "--json", "--model", str(model)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_scenario_has_rows(wan_result):
    meta, rows = wan_result["meta"], wan_result["rows"]
    assert meta["moe_layers"] == 2 and meta["workers"] == 4 and meta["quick"] is True
    petals = [r for r in rows if r["scenario"] == "petals"]
    assert {r["link"] for r in petals} == {"local", "direct", "wan"}
    assert {(r["rtt_ms"], r["bandwidth_bps"], r["wire"]) for r in petals if r["link"] == "wan"} == {
        (rtt, bandwidth, wire) for rtt in (1.0, 100.0) for bandwidth in (1e9, 1e8) for wire in ("exact-f32", "wan-int8")}
    assert {r["fanout"] for r in rows if r["scenario"] == "fanout"} == {"star", "chain"}
    assert {r["prompt"] for r in rows if r["scenario"] == "speculation"} == {"verify-cost", "repetitive", "non_repetitive"}


def test_rows_are_sane(wan_result):
    for row in wan_result["rows"]:
        if "steps_per_s" in row:
            assert row["steps_per_s"] > 0 and row["step_s"] > 0 and row["steps"] > 0
        if row["scenario"] != "petals" or row["link"] == "wan":
            assert row["round_trip_ms"] > 0
            if row.get("prompt") != "verify-cost":
                assert row["remote_layers_per_step"] == pytest.approx(2)
                assert row["overhead_ratio"] > 0
                assert row["beyond_round_trips_ms"] == pytest.approx(1e3 * row["step_s"] - row["round_trips_ms"])
    for row in wan_result["rows"]:
        if row["scenario"] == "fanout":
            assert 1 <= row["workers_per_call"] <= 4 and row["expected_layer_ms"] <= row["nominal_layer_ms"]


def test_speculation_keeps_the_greedy_tokens(wan_result):
    spec = [r for r in wan_result["rows"] if r["scenario"] == "speculation" and r["prompt"] != "verify-cost"]
    assert {r["speculate"] for r in spec} == {0, 4}
    for row in spec:
        assert row["tokens_match_plain"] is True
        assert row["steps"] * (1 + row["speculate"]) >= row["new_tokens"] - 1 >= row["steps"]
        assert row["tokens_per_step"] == pytest.approx((row["new_tokens"] - 1) / row["steps"])


def test_report_renders(wan_result, tmp_path):
    pytest.importorskip("matplotlib")
    from moeswarm.bench.report import write_report

    page = write_report(wan_result, docs=tmp_path)
    text = page.read_text()
    assert "emulated" in text and wan_result["meta"]["model"] in text
    for name in ("petals.png", "fanout_limit.png", "speculation.png", "wan.json"):
        assert (tmp_path / "bench" / name).stat().st_size > 0
