"""`moeswarm bench real --quick --json` end to end: a tiny OLMoE-like model built by llama.cpp's own
converter and quantizer, then llama.cpp, moeswarm local, 2 workers on loopback and at 20/80 ms RTT, and
one worker holding every expert on loopback.

One real subprocess run (every process the bench starts is real too); the assertions check the
report's structure and what must hold of real measurements: speeds above zero, ratios computed
from the rows' own medians, exact mode's tokens identical across local and the swarms, a layer
call at 80 ms RTT no shorter than 80 ms.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from llamacpp_fixtures import require_llama_cpp

require_llama_cpp(__file__)

CONFIGS = ["llama.cpp", "local", "loopback", "loopback1", "wan20", "wan80"]
SWARMS = ["loopback", "loopback1", "wan20", "wan80"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    cache = tmp_path_factory.mktemp("bench-real")
    command = [sys.executable, "-m", "moeswarm.cli", "bench", "real", "--quick", "--json", "--repeats", "1",
               "--cache-dir", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), cache


def test_cache_keeps_only_the_quantized_file(report):
    _, cache = report
    assert [p.suffix for p in cache.iterdir()] == [".gguf"]  # the HF directory and the F16 file are gone
    assert next(cache.iterdir()).name.endswith("-Q4_K_M.gguf")


def test_meta(report):
    meta = report[0]["meta"]
    assert meta["command"].startswith("moeswarm bench real --quick")
    assert (meta["prompt_tokens"], meta["decode_tokens"], meta["quant_type"]) == (64, 32, "Q4_K_M")
    assert meta["threads"] == 2 and meta["worker_threads"] == 1 and meta["repeats"] == 1
    assert meta["llama_cpp_python"] and "use_extra_bufts=False" in meta["llama_cpp_buffers"]
    assert meta["files"][0]["file_bytes"] > 0


def test_every_configuration_measured(report):
    rows = report[0]["rows"]
    assert [r["config"] for r in rows] == CONFIGS
    for row in rows:
        assert row["shape"] == "tiny"
        assert row["decode_tokens_per_s"] > 0 and row["prompt_tokens_per_s"] > 0
        assert row["decode_tokens_per_s"] == statistics.median(row["decode_tokens_per_s_runs"])
        assert row["prompt_tokens_per_s"] == statistics.median(row["prompt_tokens_per_s_runs"])
        assert len(row["tokens"]) == 33 and row["tokens_same_every_run"]  # the prompt's token and 32 decoded
        assert row["processes"] and all(p["startup_s"] > 0 and p["rss_bytes"] > 0 for p in row["processes"])


def test_ratios_come_from_the_rows(report):
    rows = {r["config"]: r for r in report[0]["rows"]}
    llama = rows["llama.cpp"]
    for row in rows.values():
        assert row["decode_over_llama_cpp"] == pytest.approx(row["decode_tokens_per_s"] / llama["decode_tokens_per_s"])
        assert row["prompt_over_llama_cpp"] == pytest.approx(row["prompt_tokens_per_s"] / llama["prompt_tokens_per_s"])
    assert llama["decode_over_llama_cpp"] == 1.0


def test_exact_swarms_decode_the_local_tokens(report):
    rows = {r["config"]: r for r in report[0]["rows"]}
    for name in SWARMS:
        assert rows[name]["tokens"] == rows["local"]["tokens"] and rows[name]["tokens_match_local"]


def test_layer_calls_and_workers(report):
    rows = {r["config"]: r for r in report[0]["rows"]}
    assert rows["local"]["layer_calls_per_step"] == 2 and rows["local"]["layer_call_ms"] > 0
    for name in SWARMS:
        row = rows[name]
        roles = ["lone worker"] if name == "loopback1" else ["worker 0", "worker 1"]
        assert [p["role"] for p in row["processes"]][1:] == roles
        assert len(row["workers"]) == len(roles) and sum(w["trips_per_step"] for w in row["workers"]) >= 2
        assert row["worker_compute_ms"] > 0
        assert row["machinery_ms"] == pytest.approx(row["layer_call_ms"] - row["worker_compute_ms"])
        busier = max(w["compute_ms_per_trip"] for w in row["workers"])  # per call, the slowest holder's kernel counts
        assert row["kernel_imbalance_ms"] == pytest.approx(row["worker_compute_ms"] - busier)
    assert rows["loopback1"]["kernel_imbalance_ms"] == pytest.approx(0, abs=1e-9)  # one holder: no split to be uneven
    assert rows["wan20"]["layer_call_ms"] >= 20 and rows["wan80"]["layer_call_ms"] >= 80  # no trip beats its RTT


def test_decode_step_by_part(report):
    rows = {r["config"]: r for r in report[0]["rows"]}
    for name in ("local", "loopback", "loopback1"):
        parts = rows[name]["parts_ms"]
        assert parts["attention"] > 0 and parts["moe_calls"] > 0 and parts["head"] > 0
        assert sum(parts.values()) == pytest.approx(rows[name]["profiled_step_ms"])
