"""Partial sums and lossy codecs over real workers: close to exact, and cheaper on the wire."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm
from moeswarm.wire.config import WireConfig

PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5, 77, 120, 33]


@pytest.mark.parametrize(
    "mode, dispatch, combine, min_cosine",
    [("partial", None, None, 0.99999), ("partial", "bf16", "bf16", 0.999), ("partial", "int8-b64", "int8-b64", 0.999),
     ("exact", "fp8-b128", "f16", 0.99)],
)
def test_reduced_wire_stays_close(qwen2_moe, qwen2_workers, mode, dispatch, combine, min_cosine):
    local = Stepper(load_local(qwen2_moe)).forward(PROMPT)
    with open_swarm(qwen2_moe, qwen2_workers, wire=WireConfig(mode, dispatch, combine)) as swarm:
        remote = Stepper(swarm.model).forward(PROMPT)
        summary = swarm.accounting()
    cosine = torch.nn.functional.cosine_similarity(remote, local, dim=-1)
    assert cosine.min() > min_cosine, cosine
    assert summary["layer_calls"] == len(swarm.moe_layers)  # one prefill forward: one call per MoE layer
    assert summary["round_trips"] == len(swarm.moe_layers)  # star: one trip per layer whatever the workers


def test_partial_sends_fewer_bytes_back_than_exact(qwen2_moe, qwen2_workers):
    inbound = {}
    for mode in ("exact", "partial"):
        with open_swarm(qwen2_moe, qwen2_workers, wire=WireConfig(mode)) as swarm:
            Stepper(swarm.model).forward(PROMPT)
            inbound[mode] = swarm.accounting()["bytes_in"]
    assert inbound["partial"] < inbound["exact"]


def test_workers_say_their_experts_cpu_time_when_asked_and_only_then(qwen2_moe, qwen2_workers):
    """With `timings`, every RESULT of a `moeswarm worker` carries its experts' CPU time (`cpu_us`):
    the accounting has it for every worker, above zero and below that worker's mean round trip, and
    the logits are the same bits. Without, no RESULT says it (no bytes spent on it)."""
    logits, said = {}, {}
    for timings in (False, True):
        with open_swarm(qwen2_moe, qwen2_workers, wire=WireConfig(timings=timings)) as swarm:
            logits[timings] = Stepper(swarm.model).forward(PROMPT)
            summary = swarm.accounting()
        said[timings] = summary["worker_cpu_ms_mean"]
    assert said[False] == {} and torch.equal(logits[False], logits[True])
    assert sorted(said[True]) == sorted(summary["worker_rtt_ms_mean"]) == sorted(qwen2_workers)
    for worker, cpu_ms in said[True].items():
        assert 0 < cpu_ms < summary["worker_rtt_ms_mean"][worker]


def _run_side_by_side(*commands: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Each command as `subprocess.run` runs it, all started at once (their waits overlap); results in order."""
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for command in commands]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
        return [subprocess.CompletedProcess(command, process.returncode, out, err)
                for command, process, (out, err) in zip(commands, processes, outputs)]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_gate_command_passes_lossless_and_fails_impossible_threshold(qwen2_moe, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"text": t}) for t in ["def f(x):\n    return x", "import os\nprint(1)"]))
    base = [sys.executable, "-m", "moeswarm.cli", "gate", "--model", qwen2_moe, "--prompts", str(prompts), "--json"]
    done, strict, bad = _run_side_by_side(base + ["--combine", "partial"],
                                          base + ["--wire-dispatch", "fp8-b128", "--min-cosine", "1.01"],
                                          base + ["--wire-combine", "int3"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] and report["argmax_agreement"] == 1.0 and report["cosine_mean"] > 0.9999
    assert report["positions"] == len("def f(x):\n    return x") + len("import os\nprint(1)")
    assert strict.returncode == 1 and json.loads(strict.stdout)["passed"] is False
    assert bad.returncode == 2 and "unknown combine codec 'int3'" in bad.stderr


def test_generate_wan_preset_is_cheaper_and_close(qwen2_moe, qwen2_workers):
    base = [sys.executable, "-m", "moeswarm.cli", "generate", "--model", qwen2_moe, "--workers", ",".join(qwen2_workers),
            "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4", "--threads", "1", "--json"]
    runs = _run_side_by_side(base, base + ["--wire", "wan"])
    for done in runs:
        assert done.returncode == 0, done.stderr
    exact, wan = [json.loads(done.stdout) for done in runs]
    assert exact["mode"] == "exact" and wan["mode"] == "partial"
    assert wan["bytes_in_per_token_layer"] < exact["bytes_in_per_token_layer"] / 2
