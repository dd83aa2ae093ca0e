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
import torch

from llamacpp_fixtures import require_llama_cpp

require_llama_cpp(__file__)

CONFIGS = ["local", "loopback", "loopback1", "wan20", "wan80"]
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
    assert meta["threads"] == 2 and meta["worker_threads"] == 2 and meta["repeats"] == 1
    assert meta["llama_cpp_python"] and "default buffer types" in meta["llama_cpp_buffers"]
    assert meta["files"][0]["file_bytes"] > 0
    probe = meta["files"][0]["llama_cpp_default_buffers"]
    assert probe == "run" or probe.startswith("crash: ")


def _llama_rows(meta: dict) -> list[str]:
    """llama.cpp as it ships, and its plain buffers beside it; the plain one alone where the default crashes."""
    return ["llama.cpp", "llama.cpp plain"] if meta["files"][0]["llama_cpp_default_buffers"] == "run" else ["llama.cpp"]


def test_every_configuration_measured(report):
    rows = report[0]["rows"]
    assert [r["config"] for r in rows] == _llama_rows(report[0]["meta"]) + CONFIGS
    labels = {r["config"]: r["label"] for r in rows}
    assert ("default buffer types" in labels["llama.cpp"]) == (len(_llama_rows(report[0]["meta"])) == 2)
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
        assert row["worker_rtt_ms"] > 0 and row["worker_loop_ms"] > 0
    row = rows["loopback1"]  # its one worker has one thread: a RESULT's cpu_us times its kernels whole
    assert row["worker_threads"] == 1 and row["worker_compute_ms"] > 0
    assert row["machinery_ms"] == pytest.approx(row["layer_call_ms"] - row["worker_compute_ms"])
    assert row["kernel_imbalance_ms"] == pytest.approx(0, abs=1e-9)  # one holder: no split to be uneven
    for name in ("loopback", "wan20", "wan80"):  # workers of 2 threads: cpu_us is one thread's share, no kernel time
        row = rows[name]
        assert row["worker_threads"] == 2
        assert row["worker_compute_ms"] is None and row["machinery_ms"] is None and "kernel_imbalance_ms" not in row
    assert rows["wan20"]["layer_call_ms"] >= 20 and rows["wan80"]["layer_call_ms"] >= 80  # no trip beats its RTT


def test_decode_step_by_part(report):
    rows = {r["config"]: r for r in report[0]["rows"]}
    for name in ("local", "loopback", "loopback1"):
        parts = rows[name]["parts_ms"]
        assert parts["attention"] > 0 and parts["moe_calls"] > 0 and parts["head"] > 0
        assert sum(parts.values()) == pytest.approx(rows[name]["profiled_step_ms"])


def test_a_latent_shape_converts_and_runs_as_deepseek_v3(tmp_path):
    """bench real's GLM-4.7-Flash shape at toy sizes, built as its file is (our checkpoint names
    through llama.cpp's converter and quantizer): moeswarm reads it as DeepSeek V3 with the shape's
    latent sizes, a dense first layer and a shared expert; every layer's steps, the prompt's too,
    run absorbed through the file's attn_k_b and attn_v_b blocks (kernels/gguf_latent.py) and agree
    with llama.cpp's logits; and the backbone decodes as its local reference does, bit for bit."""
    from dataclasses import replace

    from llamacpp_fixtures import llama_cpp_logits
    from moeswarm.forward.packed import PackedStepper, install
    from moeswarm.engine.generate import generate
    from moeswarm.sources.loading import load_local
    from moeswarm.swarm import open_swarm
    from moeswarm_bench.bench.real_build import model_file
    from moeswarm_bench.bench.real_shapes import SHAPES, Latent
    from moeswarm.kernels.gguf_latent import BLOCKS

    shape = replace(SHAPES["glm47flash"], name="toy", layers=3, hidden=256, heads=4, kv_heads=4, experts=8, inner=256,
                    top_k=2, vocab=512, latent=Latent(q_rank=256, kv_rank=256, nope=64, rope=64, value=64, shared=1,
                                                      dense_layers=1, dense_inner=512))
    path = str(model_file(shape, tmp_path))
    prompt, follow = [(7 * i + 3) % 400 + 10 for i in range(24)], [11, 57, 203, 99, 42, 7, 300, 12]
    model = load_local(path)
    config = model.config
    assert config.model_type == "deepseek_v3" and (config.kv_lora_rank, config.q_lora_rank) == (256, 256)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (64, 64, 64)
    assert (config.first_k_dense_replace, config.n_shared_experts, config.n_routed_experts) == (1, 1, 8)
    assert [hasattr(layer.self_attn, BLOCKS) for layer in model.model.layers] == [True] * 3
    install(model)
    expansions = [0]  # with the file's blocks every step absorbs, the prompt's too: kv_b_proj is never called
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda *_: expansions.__setitem__(0, expansions[0] + 1))
    stepper = PackedStepper(model)
    ours = torch.cat([stepper.forward(prompt)[-1:]] + [stepper.forward([token]) for token in follow[:-1]])  # [8, V]
    assert expansions[0] == 0
    theirs = torch.from_numpy(llama_cpp_logits(path, prompt + follow))[len(prompt) - 1 : -1]  # the same positions
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    assert float(cosine.mean()) >= 0.99 and float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.75
    with open_swarm(path, []) as swarm:
        result = generate(swarm, prompt[:5], 4, reference=load_local(swarm.source))
    assert result.check.bit_identical and result.check.positions >= 4


def test_llama_cpp_step_by_part_from_its_scheduler(report):
    """llama.cpp's decode step by part (its scheduler's eval callback, node names classified), the
    shares applied to its own unprofiled step: the parts add up to that step."""
    llama = next(r for r in report[0]["rows"] if r["config"] == "llama.cpp")
    parts = llama["parts_ms"]
    assert set(parts) == {"attention", "moe_calls", "router", "head", "other"}
    assert parts["moe_calls"] > 0 and parts["attention"] > 0 and parts["head"] > 0
    assert sum(parts.values()) == pytest.approx(llama["profiled_step_ms"])


def test_llama_cpp_nodes_fall_in_the_parts_moeswarm_reports():
    from moeswarm_bench.bench.real_llama_parts import part_of

    assert [part_of(name) for name in ("Qcur-3", "kq_soft_max", "cache_k_l0 (view)", "ffn_moe_logits-2",
                                       "ffn_moe_topk-0", "ffn_moe_gate-5", "ffn_moe_down", "result_output",
                                       "ffn_norm-1 (reshaped)", "attn_norm-0", "l_out-4")] == [
        "attention", "attention", "attention", "router", "router", "moe_calls", "moe_calls", "head", "other",
        "other", "other"]
