"""`moeswarm bench NAME`: every benchmark is one row of BENCHMARKS: its help, its flags
(moeswarm_bench/commands/bench_flags.py) and its run (moeswarm_bench/commands/bench_runs.py: one call of its tool in
moeswarm_bench/bench, then the result printed). Adding a benchmark is adding a row."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from moeswarm_bench.commands import bench_flags as flags
from moeswarm_bench.commands import bench_islands, bench_swarm
from moeswarm_bench.commands import bench_runs as runs
from moeswarm.commands._setup import add_quiet, quiet_progress, set_threads


@dataclass(frozen=True)
class Benchmark:
    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


BENCHMARKS: dict[str, Benchmark] = {
    "loopback": Benchmark("remote-on-loopback vs local: tokens/s and overhead per MoE round trip",
                          flags.loopback, runs.loopback),
    "memory": Benchmark("backbone vs full load resident memory, on a model with ~90%% routed experts",
                        flags.memory, runs.memory),
    "ping": Benchmark("a worker's PING round trip while it computes a long prefill, against idle", flags.ping, runs.ping),
    "bytes": Benchmark("bytes per token per MoE layer on the wire", flags.wire_bytes, runs.wire_bytes),
    "wan": Benchmark("decode steps/s with workers behind emulated WAN links (docs/bench.md)", flags.wan, runs.wan),
    "serve": Benchmark("concurrent streaming clients against moeswarm serve, workers at 80 ms RTT (docs/serve.md)",
                       flags.serve, runs.serve),
    "worker": Benchmark("one worker at real models' expert dimensions: start-up, RSS against hosted quantized bytes, "
                        "expert compute per token vs llama.cpp (docs/bench-worker.md)", flags.worker, runs.worker),
    "real": Benchmark("whole random models at real dimensions (OLMoE-1B-7B, Qwen3-30B-A3B) against llama.cpp on the "
                      "same Q4_K_M file: local, 2 workers on loopback and at 20/80 ms RTT (docs/bench-real.md)",
                      flags.real, runs.real),
    "products": Benchmark("one-row products of a real file's tensors from DRAM (attention, head, a token's experts) at 1 "
                          "and 2 threads, idle and beside a busy process: min and median; --against ggml: against "
                          "ggml's, plain and repacked (docs/bench-real.md)",
                          flags.products, runs.products),
    "fuzz": Benchmark("fuzz a live worker: crashes, hangs, wrong replies, RSS (docs/protocol.md, Limits)",
                      flags.fuzz, runs.fuzz),
    "flood": Benchmark("a well-behaved client's latency before and during floods of a worker", flags.flood, runs.flood),
    "faults": Benchmark("generations through WAN faults and SIGKILL with a replica of every expert, the tail with one "
                        "slow worker, spot checks against a liar (docs/failover.md)", flags.faults, runs.faults),
    "relay": Benchmark("time per layer call through a relay against direct, on loopback and at 50 ms RTT, TLS on both "
                       "(docs/network.md)", flags.relay, runs.relay),
    "discovery": Benchmark("workers joining and leaving a swarm on hivemind's DHT: seconds from announcement to use, "
                           "from kill or clean stop to drop (docs/discovery.md)", flags.discovery, runs.discovery),
    "federation": Benchmark("aggregate decode tokens/s of 1, 2 and 4 backbones sharing 4 workers at 80 ms RTT, and the "
                            "workers' merged calls (docs/federation.md)", flags.federation, runs.federation),
    "drafters": Benchmark("tokens per verify step of the model-free drafters (ngram, suffix) on held-out prompts and a "
                          "file-editing workload; with --rtts, the default speculation against --speculate 0 and fixed "
                          "K over emulated WAN links, star and 2 islands (docs/drafts.md)", flags.drafters, runs.drafters),
    "islands": Benchmark("a star of remote experts against chains of 1, 2 and 4 stages (islands) over the same emulated "
                         "WAN links at 20/50/100 ms, on the real-dimension OLMoE-shaped file (docs/bench-islands.md)",
                         bench_islands.flags, bench_islands.run),
    "kv-cache": Benchmark("decode ms/token and cache memory at long contexts, keys and values in float32 or float16 "
                          "(--kv-cache f16), side by side on the real-dimension OLMoE-shaped file (docs/kv-cache.md)",
                          flags.kv_cache, runs.kv_cache),
    "swarm": Benchmark("N joiners of an invite (2, 4, 8) on loopback: seconds from join to serving, bytes fetched against "
                       "each share's, coverage and a running stream's tokens/s through K random kills and rejoins, "
                       "rebalancing moves (docs/bench-swarm.md)", bench_swarm.flags, bench_swarm.run),
    "fetch-slice": Benchmark("fetch-slice throughput from a seeder on loopback and through a 100 Mbit/s emulated link "
                             "(docs/slices.md)", flags.fetch_slice, runs.fetch_slice),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, benchmark in BENCHMARKS.items():
        bench_parser = sub.add_parser(name, help=benchmark.help)
        benchmark.flags(bench_parser)
        add_quiet(bench_parser)


def run(args: argparse.Namespace) -> int:
    # Backbone and workers share this machine's cores: one thread each, or idle OpenMP threads
    # spinning in one process steal the others' time and the figures measure contention.
    set_threads(1)
    quiet_progress(args)
    BENCHMARKS[args.bench].run(args)
    return 0
