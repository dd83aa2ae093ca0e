"""`moeswarm bench worker --quick`: a real GGUF layer quantized by llama.cpp, served by real worker processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("bench-worker-cache")
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "worker", "--quick", "--types", "Q4_K_M",
                           "--json", "--cache-dir", str(cache)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), cache


def test_quick_run_measures_a_quarter_and_all_experts(quick_run):
    result, cache = quick_run
    meta, rows = result["meta"], result["rows"]
    assert meta["threads"] == 1 and meta["memory_read_bandwidth_gb_s"] > 0
    assert [(r["model"], r["type"], r["hosted_experts"], r["experts_in_layer"]) for r in rows] == [
        ("tiny", "Q4_K_M", 2, 8), ("tiny", "Q4_K_M", 8, 8)]
    quarter, everything = rows
    assert everything["hosted_bytes"] == 4 * quarter["hosted_bytes"] > 0  # the file's bytes of those experts
    assert quarter["expert_types"] == {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}  # llama.cpp's Q4_K_M mix
    for row in rows:  # moeswarm opened the file at the shape it was written with
        assert row["announced"] == {"hidden_size": 256, "num_experts": 8, "held": {"0": row["hosted_experts"]}}
        assert row["startup_s"] > 0
        assert 0 < row["rss_loaded_bytes"] <= row["rss_peak_bytes"]
        assert row["rss_over_hosted"] == pytest.approx(row["rss_loaded_bytes"] / row["hosted_bytes"])
        assert [t["tokens"] for t in row["per_tokens"]] == [1, 8, 64]
        for t in row["per_tokens"]:
            # the round trip less a ping: on the tiny model within the noise of a loaded host, clamped at 0
            assert t["worker_us_per_token"] >= 0 and t["worker_cpu_us_per_token"] > 0 and t["bound_us_per_token"] > 0
            assert 1 <= t["experts_touched"] <= row["hosted_experts"]
        assert row["per_tokens"][0]["experts_touched"] == 2  # one token, top-2 of the hosted experts
    # llama.cpp runs the whole layer (every expert): compared on the all-experts row only.
    assert all("llama_cpp_layer_us_per_token" not in t for t in quarter["per_tokens"])
    assert all(t["llama_cpp_layer_us_per_token"] > 0 and t["llama_cpp_baseline_us_per_token"] > 0
               for t in everything["per_tokens"])
    # llama.cpp as it ships where it runs so; plain CPU buffers only where that failed
    assert all(t["llama_cpp_buffers"] in ("default", "plain") for t in everything["per_tokens"])
    assert sorted(p.name for p in cache.iterdir()) == [
        "v1-qwen3moe-d256-e8-i256-k2-Q4_K_M.gguf", "v1-qwen3moe-d256-e8-i32-k2-Q4_K_M.gguf"]  # no F16 or partial left


def test_cached_files_are_reused(quick_run):
    from moeswarm_bench.bench.worker_real_gguf import layer_files
    from moeswarm_bench.bench.worker_real_shapes import QUICK_SHAPE

    _, cache = quick_run
    path = layer_files(QUICK_SHAPE, ("Q4_K_M",), cache)["Q4_K_M"]
    before = path.stat().st_mtime_ns
    assert layer_files(QUICK_SHAPE, ("Q4_K_M",), cache)["Q4_K_M"].stat().st_mtime_ns == before  # not rebuilt


def test_unknown_type_is_one_line_exit_2():
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "worker", "--types", "Q4_K_M,Q5_0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        "argument --types: expected some of Q4_K_M, Q8_0 separated by commas, got 'Q4_K_M,Q5_0' "
        "(see moeswarm bench worker --help)")


def test_without_llama_cpp_python_one_line_exit_2(tmp_path):
    script = ("import sys; sys.modules['llama_cpp'] = None  # as if llama-cpp-python were not installed\n"
              "from moeswarm.cli import main\n"
              f"sys.exit(main(['bench', 'worker', '--quick', '--cache-dir', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("moeswarm bench: error: moeswarm bench worker needs llama-cpp-python to quantize "
                                   "its files: pip install 'llama-cpp-python==0.3.36'")
    assert list(tmp_path.iterdir()) == []  # nothing half-built left in the cache
