"""`moeswarm bench`: loopback overhead, PING under load, backbone memory, bytes on the wire, WAN."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


JSON_HELP = "print JSON instead of text"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    loopback = sub.add_parser("loopback", help="remote-on-loopback vs local: tokens/s and overhead per MoE round trip")
    loopback.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    loopback.add_argument("--workers", type=int, default=2, help="number of local worker processes")
    loopback.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    loopback.add_argument("--repeats", type=int, default=3, help="timed runs, local and remote each")
    loopback.add_argument("--json", action="store_true", help=JSON_HELP)
    memory = sub.add_parser("memory", help="backbone vs full load resident memory, on a model with ~90%% routed experts")
    memory.add_argument("--worker-model", action="append", default=[], metavar="PATH",
                        help="also measure workers (a quarter vs all experts) on this model directory or .gguf")
    memory.add_argument("--json", action="store_true", help=JSON_HELP)
    ping = sub.add_parser("ping", help="a worker's PING round trip while it computes a long prefill, against idle")
    ping.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled model)")
    ping.add_argument("--prefill-tokens", type=int, default=2048, help="tokens in each prefill DISPATCH that loads the worker")
    ping.add_argument("--json", action="store_true", help=JSON_HELP)
    wire = sub.add_parser("bytes", help="bytes per token per MoE layer on the wire")
    wire.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    wire.add_argument("--json", action="store_true", help=JSON_HELP)
    wan = sub.add_parser("wan", help="decode steps/s with workers behind emulated WAN links (docs/bench.md)")
    wan.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    wan.add_argument("--quick", action="store_true", help="a reduced run, for smoke tests")
    wan.add_argument("--json", action="store_true", help="print {meta, rows} as JSON: every measured row")
    wan.add_argument("--out-json", metavar="FILE", default=None, help="also write {meta, rows} to FILE")
    wan.add_argument("--report", action="store_true", help="write docs/bench.md and its plots under docs/bench/")


def run(args: argparse.Namespace) -> int:
    from moeswarm.bundled import demo_model
    from moeswarm.commands._setup import set_threads

    # Backbone and workers share this machine's cores: one thread each, or idle OpenMP threads
    # spinning in one process steal the others' time and the figures measure contention.
    set_threads(1)

    if args.bench == "loopback":
        from moeswarm.bench.loopback import run_loopback

        result = run_loopback(args.model or str(demo_model()), args.workers, args.steps, args.repeats)
        _print(result, args.json)
    elif args.bench == "ping":
        from moeswarm.bench.ping_load import run_ping_under_load

        _print(run_ping_under_load(args.model or str(demo_model()), args.prefill_tokens), args.json)
    elif args.bench == "memory":
        from moeswarm.bench.memory import MEMORY_MODEL, make_memory_model, run_memory, run_worker_memory
        from moeswarm.model.source import open_source
        from moeswarm.model.experts import num_experts_in_config

        with tempfile.TemporaryDirectory() as tmp:
            generated = make_memory_model(Path(tmp) / "memory-model")
            result = run_memory(generated)
            result["workers"] = [run_worker_memory(generated, MEMORY_MODEL["num_experts"])]
            for path in args.worker_model:
                config = open_source(path).config
                experts = num_experts_in_config(config)
                result["workers"].append(run_worker_memory(path, experts))
        _print(result, args.json)
    elif args.bench == "bytes":
        from moeswarm.bench.wire_bytes import (ALL_CONFIGS, MATCHED_CONFIGS, make_synthetic_model, model_bytes,
                                               synthetic_layer_bytes)

        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            synthetic = str(make_synthetic_model(Path(tmp) / "synthetic-3072"))
            rows += synthetic_layer_bytes(synthetic, 1, ALL_CONFIGS)  # every mode x codec pair
            rows += synthetic_layer_bytes(synthetic, 4, MATCHED_CONFIGS)
        rows += model_bytes(args.model or str(demo_model()), 2)
        if args.json:
            print(json.dumps(rows))
        else:
            _table(rows)
    elif args.bench == "wan":
        _run_wan(args, args.model or str(demo_model()))
    return 0


def _run_wan(args: argparse.Namespace, model: str) -> None:
    from moeswarm.bench.report import print_tables, write_report
    from moeswarm.bench.wan_scenarios import run_wan

    result = run_wan(model, quick=args.quick)
    flags = [f"--model {args.model}" if args.model else "", "--quick" if args.quick else "", "--report" if args.report else ""]
    result["meta"]["command"] = " ".join(["moeswarm bench wan", *filter(None, flags)])
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=1) + "\n")
    if args.report:
        write_report(result)
    if args.json:
        print(json.dumps(result))
    else:
        print_tables(result)


def _print(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        width = max(map(len, result))
        for key, value in result.items():
            print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")


def _table(rows: list[dict]) -> None:
    print(f"{'model':<18} {'mode':<8} {'dispatch':<9} {'combine':<9} {'workers':>7} {'hidden':>6} {'top_k':>5} "
          f"{'tok/frame':>9} {'out B/tok/layer':>16} {'in B/tok/layer':>15}")
    for r in rows:
        print(f"{r['model']:<18} {r['mode']:<8} {r['wire_dispatch']:<9} {r['wire_combine']:<9} {r['workers']:>7} "
              f"{r['hidden']:>6} {r['top_k']:>5} {r['tokens_per_frame']:>9} {r['bytes_out']:>16.1f} {r['bytes_in']:>15.1f}")
