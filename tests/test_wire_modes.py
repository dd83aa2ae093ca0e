"""Partial sums and lossy codecs over real workers: close to exact, and cheaper on the wire."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeswarm.generation.stepper import Stepper
from moeswarm.model.loading import load_local
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


def test_gate_command_passes_lossless_and_fails_impossible_threshold(qwen2_moe, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"text": t}) for t in ["def f(x):\n    return x", "import os\nprint(1)"]))
    base = [sys.executable, "-m", "moeswarm.cli", "gate", "--model", qwen2_moe, "--prompts", str(prompts), "--json"]
    done = subprocess.run(base + ["--combine", "partial"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] and report["argmax_agreement"] == 1.0 and report["cosine_mean"] > 0.9999
    assert report["positions"] == len("def f(x):\n    return x") + len("import os\nprint(1)")
    strict = subprocess.run(base + ["--wire-dispatch", "fp8-b128", "--min-cosine", "1.01"], capture_output=True, text=True, timeout=300)
    assert strict.returncode == 1 and json.loads(strict.stdout)["passed"] is False
    bad = subprocess.run(base + ["--wire-combine", "int3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown combine codec 'int3'" in bad.stderr


def test_generate_wan_preset_is_cheaper_and_close(qwen2_moe, qwen2_workers):
    def run(*extra):
        done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", qwen2_moe, "--workers",
                               ",".join(qwen2_workers), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4",
                               "--threads", "1", "--json", *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    exact, wan = run(), run("--wire", "wan")
    assert exact["mode"] == "exact" and wan["mode"] == "partial"
    assert wan["bytes_in_per_token_layer"] < exact["bytes_in_per_token_layer"] / 2
