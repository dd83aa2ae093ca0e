"""Backbone memory: resident memory of a backbone load against a full local load.

Each load runs in a fresh process (so allocations of one cannot hide in the other) on a generated
model whose routed experts are about 90 % of its weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_PROBE = """
import json, resource, sys, psutil, torch
from moeswarm.model.loading import load_backbone, load_local
before = psutil.Process().memory_info().rss
model = load_backbone(sys.argv[2])[0] if sys.argv[1] == "backbone" else load_local(sys.argv[2])
real = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
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


def run_memory(model_dir: Path) -> dict:
    rows = {}
    for kind in ("full", "backbone"):
        done = subprocess.run([sys.executable, "-c", _PROBE, kind, str(model_dir)], capture_output=True, text=True, check=True)
        rows[kind] = json.loads(done.stdout.strip().splitlines()[-1])
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
