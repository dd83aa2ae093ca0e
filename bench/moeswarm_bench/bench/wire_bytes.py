"""Bytes on the wire per token per MoE layer, measured on real frames between real processes.

Counted at the socket: every byte of every frame written and read (our 24-byte header, msgpack
metadata and payload; TCP/IP headers are not counted). Decode sends one token per frame; the
64-token rows carry 64 tokens in one frame per worker (a prefill, or a batch).

Two sources: (a) a synthetic MoE layer with the brief's shape (hidden 3072, top-8), driven at the
layer with random hidden states and uniformly random routing; (b) a real model generating, so
its own routing decides which workers each token reaches.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import torch

from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import local_swarm, local_workers, split_experts
from moeswarm.sources.source import open_source
from moeswarm.progress import progress
from moeswarm.swarm import connect
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.codecs import FLOAT_CODECS
from moeswarm.wire.config import COMBINE_MODES, WireConfig

# The brief's reference layer: hidden size 3072, top-8. Attention and experts are kept tiny:
# bytes on the wire depend only on the hidden size, top-k and placement.
SYNTHETIC_3072 = dict(hidden_size=3072, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=8,
                      intermediate_size=64, vocab_size=260)

SYNTHETIC_LABEL = "synthetic-3072"  # what the synthetic rows are, wherever the model was written

ALL_CONFIGS = [(mode, d, c) for mode in COMBINE_MODES for d, c in itertools.product(FLOAT_CODECS, FLOAT_CODECS)]
MATCHED_CONFIGS = [("exact", None, None)] + [(mode, c, c) for mode in COMBINE_MODES for c in FLOAT_CODECS]


def make_synthetic_model(out: Path) -> Path:
    from moeswarm.model.tiny import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model("qwen3_moe", out, **SYNTHETIC_3072)
    return out


def _row(label: str, wire: WireConfig, workers, hidden, top_k, tokens, summary) -> dict:
    return {"model": label, "mode": wire.mode.value, "wire_dispatch": wire.dispatch_codec or "lossless",
            "wire_combine": wire.combine_codec or "lossless", "workers": workers, "hidden": hidden, "top_k": top_k,
            "tokens_per_frame": tokens, "bytes_out": summary["bytes_out_per_token_layer"],
            "bytes_in": summary["bytes_in_per_token_layer"]}


def synthetic_layer_bytes(model: str, workers: int, configs=ALL_CONFIGS, frames: int = 4,
                          label: str = SYNTHETIC_LABEL) -> list[dict]:
    """Drive the synthetic layer directly: random hidden states, uniform top-k routing; rows say `label`."""
    source = open_source(model)
    config = source.config
    experts, top_k, hidden_size = config.num_experts, config.num_experts_per_tok, config.hidden_size
    generator = torch.Generator().manual_seed(0)
    rows = []
    with local_workers(model, split_experts(experts, workers)) as addresses:
        links = [TcpLink(a) for a in addresses]
        dispatcher = connect(links, source.fingerprint, experts, hidden_size, [0])
        try:
            cases = list(itertools.product(configs, (1, 64)))
            for (mode, dispatch, combine), tokens in progress(cases, desc=f"{label}, {workers} workers", unit="config"):
                dispatcher.wire = wire = WireConfig(mode, dispatch, combine)
                dispatcher.accounting.reset()
                for _ in range(frames):
                    hidden = torch.randn(tokens, hidden_size, generator=generator)  # [T, d]
                    index = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k]  # [T, k]
                    weights = torch.rand(tokens, top_k, generator=generator)  # [T, k]
                    dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
                rows.append(_row(label, wire, workers, hidden_size, top_k, tokens, dispatcher.accounting.summary()))
        finally:
            dispatcher.close()
    return rows


def model_bytes(model: str, workers: int, configs=MATCHED_CONFIGS, decode_tokens: int = 16, prefill_tokens: int = 64,
                label: str | None = None) -> list[dict]:
    """A real model generating greedily: its own routing decides who gets which tokens; rows say `label` (default: the path)."""
    label = label or str(model)
    config = open_source(model).config
    top_k = getattr(config, "num_experts_per_tok", None)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (prefill_tokens,), generator=generator).tolist()
    rows = []
    with local_swarm(model, workers) as swarm:
        for mode, dispatch, combine in progress(configs, desc=label, unit="config"):
            wire = WireConfig(mode, dispatch, combine)
            swarm.configure(wire)
            stepper = Stepper(swarm.model)
            swarm.reset_accounting()
            token = int(stepper.forward(prompt)[-1].argmax())
            prefill = swarm.accounting()
            swarm.reset_accounting()
            for _ in range(decode_tokens):
                token = int(stepper.forward([token])[-1].argmax())
            rows.append(_row(label, wire, workers, config.hidden_size, top_k, 1, swarm.accounting()))
            rows.append(_row(label, wire, workers, config.hidden_size, top_k, prefill_tokens, prefill))
    return rows


def run_wire_bytes(model: str, label: str) -> list[dict]:
    """`moeswarm bench bytes`: the synthetic layer (every mode x codec pair on 1 worker, matched pairs on 4),
    then `model` generating on 2 workers; its rows say `label`."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = str(make_synthetic_model(Path(tmp) / "synthetic-3072"))
        rows += synthetic_layer_bytes(synthetic, 1, ALL_CONFIGS)  # every mode x codec pair
        rows += synthetic_layer_bytes(synthetic, 4, MATCHED_CONFIGS)
    rows += model_bytes(model, 2, label=label)
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    """The rows as the text table `moeswarm bench bytes` prints."""
    lines = [f"{'model':<18} {'mode':<8} {'dispatch':<9} {'combine':<9} {'workers':>7} {'hidden':>6} {'top_k':>5} "
             f"{'tok/frame':>9} {'out B/tok/layer':>16} {'in B/tok/layer':>15}"]
    for r in rows:
        lines.append(f"{r['model']:<18} {r['mode']:<8} {r['wire_dispatch']:<9} {r['wire_combine']:<9} {r['workers']:>7} "
                     f"{r['hidden']:>6} {r['top_k']:>5} {r['tokens_per_frame']:>9} {r['bytes_out']:>16.1f} "
                     f"{r['bytes_in']:>15.1f}")
    return lines
