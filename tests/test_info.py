"""`moeswarm info` on model directories and GGUF files, and `moeswarm ping` against real workers.

Every number is checked against what the model is: the tiny qwen2_moe's config (tests/conftest.py,
moeswarm/model/tiny.py), and the bundled model's GGUF files whose tensors are counted here
independently, through gguf's own reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from moeswarm.sources.source import open_source
from moeswarm.sources.summary import summarize
from moeswarm.gguf.gguf_slice import write_slice

REPO = Path(__file__).resolve().parent.parent
BUNDLED_HF = REPO / "models" / "pymoe" / "hf"
BUNDLED_Q4 = REPO / "models" / "pymoe" / "gguf" / "pymoe-Q4_K_M.gguf"
BUNDLED_Q8 = REPO / "models" / "pymoe" / "gguf" / "pymoe-Q8_0.gguf"


def moeswarm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=timeout)


def side_by_side(*runs: tuple[str, ...], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Each `moeswarm ARGS...` as `moeswarm()` runs it, all started at once (their starts overlap); results in order."""
    processes = [subprocess.Popen([sys.executable, "-m", "moeswarm.cli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for args in runs]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
        return [subprocess.CompletedProcess(process.args, process.returncode, out, err)
                for process, (out, err) in zip(processes, outputs)]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_info_on_a_model_directory(qwen2_moe):
    run, text = side_by_side(("info", qwen2_moe, "--workers", "3", "--json"), ("info", qwen2_moe))
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    # tiny qwen2_moe: hidden 32, 3 layers all MoE, 8 experts of size 16, top-2, one shared expert of size 32
    assert (info["family"], info["kind"], info["layers"], info["moe_layers"]) == ("qwen2_moe", "hf", 3, [0, 1, 2])
    assert (info["experts_per_layer"], info["top_k"], info["expert_intermediate_size"]) == (8, 2, 16)
    assert (info["shared_experts"], info["shared_expert_intermediate_size"]) == (1, 32)
    assert (info["hidden_size"], info["context_length"], info["vocab_size"]) == (32, 256, 260)
    routed = 3 * 8 * (2 * 16 * 32 + 32 * 16)  # layers x experts x (gate_up [2I, H] + down [H, I])
    assert info["parameters"]["experts"] == routed
    assert info["tensor_types"] == {"F32": sum(info["tensor_types"].values())}
    assert info["bytes"]["experts"] == 4 * routed  # float32, nothing else counted as routed
    assert info["bytes"]["backbone"] == 4 * info["parameters"]["backbone"]
    assert info["fingerprint"] == open_source(qwen2_moe).fingerprint
    assert info["split"] == {"workers": 3, "experts": ["0-2", "3-4", "5-7"],
                             "expert_bytes": [4 * routed * 3 // 8, 4 * routed * 2 // 8, 4 * routed * 3 // 8]}
    assert info["held"] is None and info["quantization"] is None

    assert text.returncode == 0, text.stderr
    assert "experts per layer   8, top-2" in text.stdout
    assert "--experts 0-3 " in text.stdout and "--experts 4-7 " in text.stdout


@pytest.mark.skipif(not BUNDLED_Q4.is_file(), reason="the bundled GGUF files are not in this checkout")
def test_info_on_a_gguf_file_counts_its_tensors_by_type():
    info = summarize(BUNDLED_Q4, workers=4)
    reader = GGUFReader(BUNDLED_Q4)
    routed = [t for t in reader.tensors if "_exps." in t.name]
    assert len(routed) == 6 * 3  # gate, up and down of each of the 6 MoE layers
    assert info["bytes"]["experts"] == sum(int(t.n_bytes) for t in routed)
    assert info["bytes"]["total"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(info["tensor_types"].values()) == len(reader.tensors)
    assert info["tensor_types"]["Q4_K"] >= 1 and info["quantization"] == "Q4_K_M"
    assert (info["family"], info["kind"], info["moe_layers"], info["experts_per_layer"], info["top_k"]) == (
        "qwen2_moe", "gguf", list(range(6)), 32, 8)
    assert info["split"]["experts"] == ["0-7", "8-15", "16-23", "24-31"]
    # the same model as the directory it was converted from: the same parameters, far fewer bytes
    from_directory = summarize(BUNDLED_HF)
    assert info["parameters"] == from_directory["parameters"]
    assert info["bytes"]["experts"] < from_directory["bytes"]["experts"] / 4


@pytest.mark.skipif(not BUNDLED_Q8.is_file(), reason="the bundled GGUF files are not in this checkout")
def test_info_on_a_slice_file_says_what_it_holds(tmp_path):
    part = tmp_path / "part.gguf"
    write_slice(BUNDLED_Q8, part, list(range(8, 16)))
    whole, sliced = summarize(BUNDLED_Q8), summarize(part)
    assert sliced["held"] == {"layers": list(range(6)), "experts": list(range(8, 16))}
    assert sliced["fingerprint"] == whole["fingerprint"]
    assert sliced["experts_per_layer"] == 32  # the model's, not the slice's
    assert sliced["bytes"]["experts"] * 4 == whole["bytes"]["experts"]  # 8 of 32 experts, byte for byte
    assert sliced["split"]["expert_bytes"] == whole["split"]["expert_bytes"]


def test_make_model_prints_the_summary(tmp_path):
    run = moeswarm("make-model", "--family", "qwen3_moe", "--out", str(tmp_path / "m"))
    assert run.returncode == 0, run.stderr
    assert "qwen3_moe (model directory)" in run.stdout
    assert "experts per layer   8, top-2, expert intermediate size 16" in run.stdout
    assert "shared experts      0" in run.stdout


def test_ping_reports_each_worker_and_the_unreachable_one(qwen2_moe, qwen2_workers):
    unreachable = "127.0.0.1:1"
    run, text = side_by_side(("ping", ",".join([*qwen2_workers, unreachable]), "--model", qwen2_moe, "--count", "3", "--json"),
                             ("ping", ",".join([*qwen2_workers, unreachable]), "--model", qwen2_moe))
    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    first, second, down = report["workers"]
    fingerprint = open_source(qwen2_moe).fingerprint
    for worker, experts in ((first, [0, 1, 2, 3]), (second, [4, 5, 6, 7])):
        assert worker["ok"] and worker["fingerprint"] == fingerprint and worker["model_type"] == "qwen2_moe"
        assert worker["held"] == {"0": experts, "1": experts, "2": experts}
        assert worker["pings"] == 3 and 0 < worker["rtt_us_min"] <= worker["rtt_us_p50"]
    assert down == {"address": unreachable, "ok": False, "error": down["error"]}
    assert "cannot connect" in down["error"]

    assert text.returncode == 1
    lines = text.stdout.splitlines()
    assert len(lines) == 2 and "layers 0-2 experts 0-3 (of 8)" in lines[0] and "layers 0-2 experts 4-7 (of 8)" in lines[1]
    assert text.stderr.count("\n") == 1 and unreachable in text.stderr and "Traceback" not in text.stderr


def test_ping_names_a_worker_of_another_model(tiny_models, qwen2_workers):
    other = tiny_models("qwen3_moe")
    run = moeswarm("ping", qwen2_workers[0], "--model", other)
    assert run.returncode == 1
    assert "model fingerprint mismatch" in run.stderr and "qwen2_moe" in run.stderr
    assert run.stderr.count("\n") == 1
