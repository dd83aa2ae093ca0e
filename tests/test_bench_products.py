"""`moeswarm bench products` end to end on a tiny Q4_K_M file made by llama.cpp's tools: every group at
1 and 2 threads, idle and beside a busy process, with figures that come from real timings."""

from __future__ import annotations

import json
import subprocess
import sys

from llamacpp_fixtures import require_llama_cpp

require_llama_cpp(__file__)


def test_products_bench_reports_every_group_threads_and_neighbour(qwen3_q4_k_m):
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "products", "--model", qwen3_q4_k_m,
                           "--repeats", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    rows = result["rows"]
    assert [(r["group"], r["threads"], r["neighbour"]) for r in rows] == [
        (group, threads, neighbour) for neighbour in ("idle", "busy") for group in ("attention", "head", "experts")
        for threads in (1, 2)]
    for row in rows:
        assert 0 < row["min_ms"] <= row["median_ms"] and row["median_over_min"] >= 1.0
    assert {r["matrices"] for r in rows if r["group"] == "head"} == {1}
    assert result["meta"]["tuning"]["prefetch"] in ("none", "l2", "nta")


def test_products_against_ggml_times_every_side_or_reports_its_crash(qwen3_q4_k_m):
    """--against ggml: per group, moeswarm's row and one per ggml buffer type this host has (plain first),
    each timed from real passes and computing the same products as moeswarm's (or a crash as a row)."""
    from moeswarm_bench.bench.products_ggml import ggml_buffer_types

    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "products", "--model", qwen3_q4_k_m,
                           "--repeats", "2", "--against", "ggml", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    sides = ["moeswarm", "moeswarm-anon", *ggml_buffer_types()]
    assert sides[2] == "CPU"
    assert [(r["group"], r["side"]) for r in result["rows"]] == [
        (group, side) for group in ("attention", "head", "experts") for side in sides]
    matrices = {r["group"]: r["placement"]["moeswarm"] for r in result["rows"] if r["side"] == "moeswarm"}
    assert [r["max_rel_diff"] for r in result["rows"] if r["side"] == "moeswarm-anon"] == [0.0] * 3  # the same bits
    assert matrices["head"] == 1
    for row in result["rows"]:
        if row["side"] in ("moeswarm", "moeswarm-anon", "CPU"):  # the plain buffers run everywhere
            assert row["status"] == "ok"
        if row["status"] == "ok":
            assert 0 < row["min_ms"] <= row["median_ms"] and row["passes"] == 2
            assert row["max_rel_diff"] < 1e-3  # the same products (int8 activations on both sides)
            assert sum(row["placement"].values()) == matrices[row["group"]]  # every weight placed once
        else:
            assert row["status"].startswith("crashed: ")
