"""Each benchmark's run: its flags into one call of its tool (moeswarm/tools/bench), then the result
printed. One function per benchmark, named in commands/bench.py's table; each imports its tool
when called, so one benchmark's optional dependencies (llama.cpp, hivemind, openai) never burden another."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from moeswarm.bundled import demo_model
from moeswarm.errors import MoeSwarmError


def loopback(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.loopback import run_loopback

    print_result(run_loopback(_model(args), args.workers, args.steps, args.repeats), args.json)


def ping(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.ping_load import run_ping_under_load

    print_result(run_ping_under_load(_model(args), args.prefill_tokens), args.json)


def memory(args: argparse.Namespace) -> None:
    from moeswarm.model.experts import num_experts_in_config
    from moeswarm.model.source import open_source
    from moeswarm.tools.bench.memory import MEMORY_MODEL, make_memory_model, run_memory, run_worker_memory

    with tempfile.TemporaryDirectory() as tmp:
        generated = make_memory_model(Path(tmp) / "memory-model")
        result = run_memory(generated)
        result["workers"] = [run_worker_memory(generated, MEMORY_MODEL["num_experts"])]
        for path in args.worker_model:
            result["workers"].append(run_worker_memory(path, num_experts_in_config(open_source(path).config)))
    print_result(result, args.json)


def wire_bytes(args: argparse.Namespace) -> None:
    from moeswarm.bundled import PYMOE
    from moeswarm.tools.bench.wire_bytes import (ALL_CONFIGS, MATCHED_CONFIGS, make_synthetic_model, model_bytes,
                                                 synthetic_layer_bytes)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = str(make_synthetic_model(Path(tmp) / "synthetic-3072"))
        rows += synthetic_layer_bytes(synthetic, 1, ALL_CONFIGS)  # every mode x codec pair
        rows += synthetic_layer_bytes(synthetic, 4, MATCHED_CONFIGS)
    rows += model_bytes(_model(args), 2, label=args.model or f"{PYMOE.name} (bundled)")
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'model':<18} {'mode':<8} {'dispatch':<9} {'combine':<9} {'workers':>7} {'hidden':>6} {'top_k':>5} "
          f"{'tok/frame':>9} {'out B/tok/layer':>16} {'in B/tok/layer':>15}")
    for r in rows:
        print(f"{r['model']:<18} {r['mode']:<8} {r['wire_dispatch']:<9} {r['wire_combine']:<9} {r['workers']:>7} "
              f"{r['hidden']:>6} {r['top_k']:>5} {r['tokens_per_frame']:>9} {r['bytes_out']:>16.1f} {r['bytes_in']:>15.1f}")


def wan(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.report import print_tables, write_report
    from moeswarm.tools.bench.wan_scenarios import run_wan

    result = run_wan(_model(args), quick=args.quick, scenarios=args.scenarios)
    flags = [f"--model {args.model}" if args.model else "", "--quick" if args.quick else "", "--report" if args.report else "",
             f"--scenarios {','.join(args.scenarios)}" if args.scenarios else ""]
    result["meta"]["command"] = " ".join(["moeswarm bench wan", *filter(None, flags)])
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=1) + "\n")
    if args.report:
        write_report(result)
    if args.json:
        print(json.dumps(result))
    else:
        print_tables(result)


def serve(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.serve_load import run_serve_bench, table_lines

    def show(row: dict) -> None:
        if sys.stderr.isatty() and not args.quiet:
            print(f"clients {row['clients']:>2} speculate {row['speculate']} groups {row['groups_flag'] or 'auto'}: "
                  f"{row['aggregate_tokens_per_s']:.2f} tokens/s", file=sys.stderr)

    model, workers = _model(args), args.workers or 4
    if model == "real":
        from moeswarm.tools.bench.real_build import DEFAULT_CACHE, model_file
        from moeswarm.tools.bench.real_shapes import SHAPES

        model, workers = str(model_file(SHAPES["olmoe"], DEFAULT_CACHE)), args.workers or 2
    command = "moeswarm bench " + " ".join(sys.argv[sys.argv.index("serve"):]) if "serve" in sys.argv else "moeswarm bench serve"
    result = run_serve_bench(model, args.quick, args.max_tokens, show, args.clients, args.speculate, args.serve_threads,
                             args.groups, workers, command)
    if args.report:
        from moeswarm.tools.bench.serve_report import write_serve_report

        write_serve_report(result)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def worker(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.worker_real import run_bench_worker
    from moeswarm.tools.bench.worker_real_gguf import DEFAULT_CACHE
    from moeswarm.tools.bench.worker_real_report import table_lines

    cache = Path(args.cache_dir).expanduser() if args.cache_dir else DEFAULT_CACHE
    result = run_bench_worker(args.models, args.types, cache, args.threads, args.quick)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def real(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.real_build import DEFAULT_CACHE
    from moeswarm.tools.bench.real_measure import run_bench_real
    from moeswarm.tools.bench.real_report import table_lines, write_report
    from moeswarm.tools.bench.real_shapes import DEFAULT_SHAPES

    if args.quick and args.shapes:
        raise MoeSwarmError("--quick measures its own tiny model: give --shapes or --quick, not both")
    shapes = args.shapes or DEFAULT_SHAPES
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else DEFAULT_CACHE
    result = run_bench_real(shapes, cache, args.threads, args.repeats, args.quick)
    flags = ["--quick" if args.quick else f"--shapes {','.join(shapes)}", f"--threads {args.threads}",
             f"--repeats {args.repeats}"]
    result["meta"]["command"] = " ".join(["moeswarm bench real", *flags])
    if args.report:
        write_report(result)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def fuzz(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.fuzz import run_fuzz

    def progress(done: int, counts: dict) -> None:
        print(f"fuzz: {done} cases, findings {counts or 'none'}", file=sys.stderr, flush=True)

    print_result(run_fuzz(args.cases, args.seed, args.model, progress=progress), args.json)


def flood(args: argparse.Namespace) -> None:
    if args.handshakes is not None:
        from moeswarm.tools.bench.handshake_flood import run_handshake_flood

        print_result(run_handshake_flood(args.handshakes), args.json)
    elif args.amplification:
        from moeswarm.tools.bench.amplification import run_amplification

        print_result(run_amplification(args.connections, args.tokens, args.top_k, args.hold), args.json)
    else:
        from moeswarm.tools.bench.flood import run_flood

        print_result(run_flood(args.half_open, args.flooders, args.samples), args.json)


def faults(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.faults import print_report, run_faults

    result = run_faults(_model(args), args.generations, tuple(args.parts.split(",")), args.seed, args.liar_trials)
    print(json.dumps(result)) if args.json else print_report(result)


def relay(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.relay import report_lines, run_relay_bench

    result = run_relay_bench(_model(args), args.rtt_ms, args.steps, args.repeats)
    print(json.dumps(result) if args.json else "\n".join(report_lines(result)))


def discovery(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.discovery import run_discovery

    print_result(run_discovery(_model(args), args.rounds, args.ttl, args.poll), args.json)


def federation(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.federation import report_lines, run_federation

    result = run_federation(_model(args), args.new_tokens, wire=args.wire)
    print(json.dumps(result) if args.json else "\n".join(report_lines(result)))


def drafters(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.drafters import run_drafters_bench, table_lines

    result = run_drafters_bench()
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def fetch_slice(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.fetch_slice import report_lines, run_fetch_bench

    result = run_fetch_bench(args.size_mb)
    print(json.dumps(result) if args.json else "\n".join(report_lines(result)))


def print_result(result: dict, as_json: bool) -> None:
    """A flat result: one JSON object, or one `key  value` line per key."""
    if as_json:
        print(json.dumps(result))
        return
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")


def _model(args: argparse.Namespace) -> str:
    """--model, or the bundled model."""
    return args.model or str(demo_model())
