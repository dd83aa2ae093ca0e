"""`moeswarm bench fetch-slice`: how fast a joining worker fetches its slice from a seeder.

A random GGUF file shaped like an MoE model (routed-expert tensors `blk.L.ffn_{gate,up,down}_exps`
holding about `size_mb` MB, plus small backbone tensors) is written, its manifest made, and a
seeder (`moeswarm seed`, a subprocess) serves it with a swarm key (TLS). A quarter of the experts
is fetched with `moeswarm fetch-slice` (a subprocess), on loopback and through a WanProxy at
100 Mbit/s (moeswarm/wan), and the result is compared byte for byte with `moeswarm slice`'s.
Rows: fetched MB, seconds of fetching (connection to last piece checked), MB/s and Mbit/s.
"""

from __future__ import annotations

import asyncio
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import format_ids
from moeswarm_bench.wan import LinkProfile, WanProxy

ARCH = "qwen2moe"
EXPERTS = 32
LAYERS = 4
HIDDEN = 256
WAN_BPS = 100e6


def make_random_gguf(path: str | Path, expert_mb: float, experts: int = EXPERTS, layers: int = LAYERS,
                     hidden: int = HIDDEN, seed: int = 0) -> Path:
    """A GGUF file with the metadata and tensor names of a qwen2moe model, random f32 weights,
    about `expert_mb` MB of routed experts. Not a model to run: a file to slice, seed and fetch."""
    rng = np.random.default_rng(seed)
    ffn = max(1, int(expert_mb * 1e6 / (layers * experts * 3 * hidden * 4)))  # [E, ffn, hidden] x 3 per layer
    writer = GGUFWriter(str(path), ARCH)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(min(8, experts))
    writer.add_expert_feed_forward_length(ffn)
    writer.add_tensor("token_embd.weight", rng.standard_normal((64, hidden), dtype=np.float32))
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", rng.standard_normal(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((experts, hidden), dtype=np.float32))
        for part in ("gate", "up"):
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight",
                              rng.standard_normal((experts, ffn, hidden), dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", rng.standard_normal((experts, hidden, ffn), dtype=np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def run_fetch_bench(size_mb: float = 64.0) -> dict:
    """{meta, rows}: loopback and 100 Mbit/s rows (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_random_gguf(tmp / "model.gguf", size_mb)
        _cli("manifest", str(model), "-o", str(tmp / "model.manifest.json"), "--quiet")
        _cli("keygen", "-o", str(tmp / "swarm.key"))
        experts = format_ids(range(EXPERTS // 4))
        _cli("slice", str(model), "--experts", experts, "-o", str(tmp / "expected.gguf"), "--quiet")
        seeder = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "seed", "--model", str(model),
                                   "--swarm-key", str(tmp / "swarm.key")], stdout=subprocess.PIPE, text=True)
        try:
            address = seeder.stdout.readline().split("listening on ", 1)[1].split()[0]
            rows = [_fetch(tmp, "loopback", address, experts)]
            with _proxy(address, LinkProfile(rtt_s=0.0, bandwidth_bps=WAN_BPS)) as proxied:
                rows.append(_fetch(tmp, "wan 100 Mbit/s", proxied, experts))
        finally:
            seeder.terminate()
            seeder.wait(30)
        meta = {"model_bytes": model.stat().st_size, "experts_fetched": experts, "of_experts": EXPERTS,
                "tls": True, "cpus": os.cpu_count(),
                "note": "seeder, fetcher and proxy share this machine's cores; figures are noisy"}
    return {"meta": meta, "rows": rows}


def _fetch(tmp: Path, path: str, address: str, experts: str) -> dict:
    out = tmp / f"fetched-{len(list(tmp.glob('fetched-*')))}.gguf"
    report = json.loads(_cli("fetch-slice", address, "--manifest", str(tmp / "model.manifest.json"),
                             "--experts", experts, "-o", str(out), "--swarm-key", str(tmp / "swarm.key"),
                             "--json", "--quiet").splitlines()[-1])
    if not filecmp.cmp(out, tmp / "expected.gguf", shallow=False):
        raise MoeSwarmError(f"the fetched slice differs from `moeswarm slice`'s ({path})")
    seconds = report["fetch_s"]
    return {"path": path, "fetched_mb": round(report["fetched_bytes"] / 1e6, 2), "slice_mb": round(out.stat().st_size / 1e6, 2),
            "fetch_s": seconds, "mb_per_s": round(report["fetched_bytes"] / seconds / 1e6, 2),
            "mbit_per_s": round(report["fetched_bytes"] * 8 / seconds / 1e6, 1), "identical_to_slice": True}


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise MoeSwarmError(f"moeswarm {args[0]} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


class _proxy:
    """A WanProxy in front of `upstream`, on a background event loop; yields its address."""

    def __init__(self, upstream: str, profile: LinkProfile):
        host, port = upstream.rsplit(":", 1)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.proxy = WanProxy(("127.0.0.1", 0), (host, int(port)), profile)

    def __enter__(self) -> str:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(30)
        return "%s:%d" % self.proxy.address

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def report_lines(result: dict) -> list[str]:
    meta = result["meta"]
    lines = [f"model {meta['model_bytes'] / 1e6:.1f} MB, experts {meta['experts_fetched']} of {meta['of_experts']}, "
             f"TLS with a swarm key ({meta['note']})",
             f"{'path':<16} {'fetched MB':>10} {'seconds':>8} {'MB/s':>8} {'Mbit/s':>8}  identical to `moeswarm slice`"]
    for row in result["rows"]:
        lines.append(f"{row['path']:<16} {row['fetched_mb']:>10.2f} {row['fetch_s']:>8.3f} {row['mb_per_s']:>8.2f} "
                     f"{row['mbit_per_s']:>8.1f}  {row['identical_to_slice']}")
    return lines
