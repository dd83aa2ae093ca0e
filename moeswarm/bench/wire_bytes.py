"""Bytes on the wire per token per MoE layer, measured on real frames between real processes.

Counted at the socket: every byte of every frame written and read (our 24-byte header, msgpack
metadata and payload; TCP/IP headers are not counted). Decode sends one token per frame; the
64-token row is a prefill of 64 tokens in one frame per worker.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeswarm.generation.stepper import Stepper
from moeswarm.local_workers import local_workers, split_experts
from moeswarm.model.checkpoint import Checkpoint
from moeswarm.model.experts import NUM_EXPERTS_KEYS
from moeswarm.swarm import connect_swarm

# The brief's reference layer: hidden size 3072, top-8. Attention and experts are kept tiny:
# bytes on the wire depend only on the hidden size, top-k and placement.
SYNTHETIC_3072 = dict(hidden_size=3072, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, num_experts=16, num_experts_per_tok=8, moe_intermediate_size=16,
                      intermediate_size=64, vocab_size=260)

WIRE_CONFIGS = [("exact", None, None)]  # (mode, wire_dispatch, wire_combine); None: lossless


def make_synthetic_model(out: Path) -> Path:
    from moeswarm.model.tiny import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model("qwen3_moe", out, **SYNTHETIC_3072)
    return out


def measure_bytes(model: str, workers: int, configs=WIRE_CONFIGS, decode_tokens: int = 16, prefill_tokens: int = 64) -> list[dict]:
    config = Checkpoint.open(model).config
    num_experts = next(getattr(config, k) for k in NUM_EXPERTS_KEYS if isinstance(getattr(config, k, None), int))
    top_k = getattr(config, "num_experts_per_tok", None)
    rows = []
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (prefill_tokens,), generator=generator).tolist()
    with local_workers(model, split_experts(num_experts, workers)) as addresses:
        for mode, wire_dispatch, wire_combine in configs:
            swarm = connect_swarm(model, addresses, mode=mode, wire_dispatch=wire_dispatch, wire_combine=wire_combine)
            try:
                stepper = Stepper(swarm.model)
                accounting = swarm.dispatcher.accounting
                accounting.reset()
                token = int(stepper.forward(prompt)[-1].argmax())
                prefill = accounting.summary()
                accounting.reset()
                for _ in range(decode_tokens):
                    token = int(stepper.forward([token])[-1].argmax())
                decode = accounting.summary()
            finally:
                swarm.close()
            for tokens_per_frame, summary in ((1, decode), (prefill_tokens, prefill)):
                rows.append({
                    "model": Path(model).name, "mode": mode,
                    "wire_dispatch": wire_dispatch or "lossless", "wire_combine": wire_combine or "lossless",
                    "workers": workers, "hidden": config.hidden_size, "top_k": top_k,
                    "tokens_per_frame": tokens_per_frame,
                    "bytes_out": summary["bytes_out_per_token_layer"], "bytes_in": summary["bytes_in_per_token_layer"],
                })
    return rows
