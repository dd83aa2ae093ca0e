"""Memory: a backbone against a full local load, and a worker hosting a quarter of the experts
against one hosting all of them.

Each load runs in a fresh process (so allocations of one cannot hide in the other). The backbone
is measured on a generated model whose routed experts are about 90 % of its weights; workers on
that model and on any other model or GGUF file given.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

_PROBE = """
import json, resource, sys, psutil, torch
from moeswarm.ids import parse_experts
from moeswarm.sources.loading import load_backbone, load_experts, load_local
before = psutil.Process().memory_info().rss
kind, path = sys.argv[1], sys.argv[2]
if kind.startswith("worker:"):
    hosted = load_experts(path, parse_experts(kind.split(":")[1]))[0]
    params = [p for layer in hosted.values() for p in layer.module.parameters()]
else:
    params = list((load_backbone(path)[0] if kind == "backbone" else load_local(path)).parameters())
real = sum(p.numel() * p.element_size() for p in params if not p.is_meta)
if kind.startswith("worker:"):  # GGUF experts kept in the file's blocks (kernels/quant_experts.py) hold no parameters
    real += sum(getattr(layer.module, "nbytes", 0) for layer in hosted.values())
print(json.dumps({"rss_before": before, "rss_after": psutil.Process().memory_info().rss,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "param_bytes": real}))
"""

# qwen3_moe, 4 layers, 32 experts of 256 x 128: routed experts are ~90 % of the parameters.
MEMORY_MODEL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=32,
                    num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, vocab_size=2048)


def make_memory_model(out: Path) -> Path:
    from moeswarm.model.tiny import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model("qwen3_moe", out, **MEMORY_MODEL)
    return out


def _probe(kind: str, path) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, kind, str(path)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"memory probe {kind} on {path} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_worker_memory(path, num_experts: int) -> dict:
    """RSS growth of a worker hosting experts [0, E/4) against one hosting all E."""
    quarter, everything = _probe(f"worker:0-{num_experts // 4 - 1}", path), _probe(f"worker:0-{num_experts - 1}", path)
    return {
        "model": str(path),
        "quarter_experts_param_bytes": quarter["param_bytes"],
        "all_experts_param_bytes": everything["param_bytes"],
        "quarter_rss_growth": quarter["rss_after"] - quarter["rss_before"],
        "all_rss_growth": everything["rss_after"] - everything["rss_before"],
        "quarter_peak_rss": quarter["peak_rss"],
        "all_peak_rss": everything["peak_rss"],
    }


def run_memory(model_dir: Path) -> dict:
    rows = {kind: _probe(kind, model_dir) for kind in ("full", "backbone")}
    full, backbone = rows["full"], rows["backbone"]
    total_params = full["param_bytes"]
    return {
        "model": str(model_dir),
        "routed_expert_share_of_weights": 1 - backbone["param_bytes"] / total_params,
        "full_param_bytes": total_params,
        "backbone_param_bytes": backbone["param_bytes"],
        "full_rss_growth": full["rss_after"] - full["rss_before"],
        "backbone_rss_growth": backbone["rss_after"] - backbone["rss_before"],
        "full_peak_rss": full["peak_rss"],
        "backbone_peak_rss": backbone["peak_rss"],
        "baseline_rss": backbone["rss_before"],
    }


def run_memory_bench(worker_models: Sequence[str] = ()) -> dict:
    """`moeswarm bench memory`: the backbone against a full load on a generated model, then workers on that
    model and on each of `worker_models` (directories or GGUF files)."""
    from moeswarm.model.experts import num_experts_in_config
    from moeswarm.sources.source import open_source

    with tempfile.TemporaryDirectory() as tmp:
        generated = make_memory_model(Path(tmp) / "memory-model")
        result = run_memory(generated)
        result["workers"] = [run_worker_memory(generated, MEMORY_MODEL["num_experts"])]
        for path in worker_models:
            result["workers"].append(run_worker_memory(path, num_experts_in_config(open_source(path).config)))
    return result
