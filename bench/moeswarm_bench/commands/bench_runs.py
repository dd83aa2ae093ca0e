"""Each benchmark's run: its flags into one call of its tool (moeswarm_bench/bench), then the result
printed. One function per benchmark, named in moeswarm_bench/commands/bench.py's table; each imports its tool
when called, so one benchmark's optional dependencies (llama.cpp, hivemind, openai) never burden another."""

from __future__ import annotations

import argparse
import json
import os
import sys

from moeswarm.bundled import PYMOE, demo_model


def loopback(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.loopback import run_loopback

    print_result(run_loopback(_model(args), args.workers, args.steps, args.repeats), args.json)


def ping(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.ping_load import run_ping_under_load

    print_result(run_ping_under_load(_model(args), args.prefill_tokens), args.json)


def memory(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.memory import run_memory_bench

    print_result(run_memory_bench(args.worker_model), args.json)


def wire_bytes(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.wire_bytes import run_wire_bytes, table_lines

    rows = run_wire_bytes(_model(args), label=args.model or f"{PYMOE.name} (bundled)")
    print(json.dumps(rows) if args.json else "\n".join(table_lines(rows)))


def wan(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.wan_bench import run_wan_bench, table_lines

    flags = [f"--model {args.model}" if args.model else "", "--quick" if args.quick else "", "--report" if args.report else "",
             f"--scenarios {','.join(args.scenarios)}" if args.scenarios else ""]
    result = run_wan_bench(_model(args), args.quick, args.scenarios, " ".join(["moeswarm bench wan", *filter(None, flags)]),
                           out_json=args.out_json, report=args.report)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def serve(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.serve_bench import run_serve, table_lines

    def show(row: dict) -> None:
        if sys.stderr.isatty() and not args.quiet:
            print(f"clients {row['clients']:>2} speculate {row['speculate']} groups {row['groups_flag'] or 'auto'}: "
                  f"{row['aggregate_tokens_per_s']:.2f} tokens/s", file=sys.stderr)

    command = "moeswarm bench " + " ".join(sys.argv[sys.argv.index("serve"):]) if "serve" in sys.argv else "moeswarm bench serve"
    result = run_serve(_model(args), args.workers, args.quick, args.max_tokens, show, args.clients, args.speculate,
                       args.serve_threads, args.groups, command, report=args.report)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def worker(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.worker_real import run_bench_worker, table_lines

    result = run_bench_worker(args.models, args.types, args.cache_dir, args.threads, args.quick)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def real(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.real_bench import run_real, table_lines

    result = run_real(args.shapes, args.cache_dir, args.threads, args.repeats, args.quick, report=args.report)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def products(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.products import run_products_bench, table_lines

    if args.model is None:
        from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
        from moeswarm_bench.bench.real_shapes import SHAPES

        args.model = str(model_file(SHAPES["olmoe"], DEFAULT_CACHE))
    if args.against == "ggml":
        from moeswarm_bench.bench.products_ggml import run_against_ggml, table_lines
        result = run_against_ggml(args.model, args.repeats)
    else:
        result = run_products_bench(args.model, args.repeats)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def fuzz(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.fuzz import run_fuzz

    if args.files is not None:
        return fuzz_files(args)

    def progress(done: int, counts: dict) -> None:
        print(f"fuzz: {done} cases, findings {counts or 'none'}", file=sys.stderr, flush=True)

    print_result(run_fuzz(args.cases, args.seed, args.model, progress=progress), args.json)


def fuzz_files(args: argparse.Namespace) -> None:
    from moeswarm.errors import MoeSwarmError
    from moeswarm_bench.bench.file_fuzz import COMMANDS, run_file_fuzz

    commands = tuple(c for c in args.commands.split(",") if c)
    if args.files < 1 or not commands or not set(commands) <= set(COMMANDS):
        raise MoeSwarmError(f"--files takes N >= 1 and --commands some of {','.join(COMMANDS)}")

    def progress(done: int, counts: dict) -> None:
        print(f"fuzz: {done} files, findings {counts or 'none'}", file=sys.stderr, flush=True)

    print_result(run_file_fuzz(args.files, args.seed, args.model, commands, args.timeout, args.rss_cap_mb,
                               progress=progress), args.json)


def flood(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.flood import run_flood_bench

    if args.stage:
        from moeswarm_bench.bench.stage_flood import run_stage_flood

        print_result(run_stage_flood(), args.json)
        return

    print_result(run_flood_bench(args.half_open, args.flooders, args.samples, handshakes=args.handshakes,
                                 amplification=args.amplification, connections=args.connections, tokens=args.tokens,
                                 top_k=args.top_k, hold_s=args.hold), args.json)


def faults(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.faults import report_lines, run_faults

    result = run_faults(_model(args), args.generations, tuple(args.parts.split(",")), args.seed, args.liar_trials)
    print(json.dumps(result) if args.json else "\n".join(report_lines(result)))


def relay(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.relay import report_lines, run_relay_bench

    result = run_relay_bench(_model(args), args.rtt_ms, args.steps, args.repeats)
    print(json.dumps(result) if args.json else "\n".join(report_lines(result)))


def discovery(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.discovery import run_discovery

    print_result(run_discovery(_model(args), args.rounds, args.ttl, args.poll), args.json)


def federation(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.federation import report_lines, run_federation

    result = run_federation(_model(args), args.new_tokens, wire=args.wire)
    print(json.dumps(result) if args.json else "\n".join(report_lines(result)))


def drafters(args: argparse.Namespace) -> None:
    if args.rtts is not None:
        return drafters_wan(args)
    from moeswarm_bench.bench.drafters import run_drafters_bench, table_lines

    result = run_drafters_bench()
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def drafters_wan(args: argparse.Namespace) -> None:
    import platform

    from moeswarm_bench.bench.drafters_wan import run_drafters_wan, table_lines
    from moeswarm_bench.bench.drafters_wan_report import write_report

    model = args.model
    if model == "bundled":
        model = str(demo_model())
    elif model is None:
        from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
        from moeswarm_bench.bench.real_shapes import SHAPES

        model = str(model_file(SHAPES["olmoe"], DEFAULT_CACHE))
    topologies = tuple("2 islands" if t == "islands" else t for t in args.topologies)
    result = run_drafters_wan(model, args.rtts, args.fixed, args.tokens, topologies, repeats=args.repeats)
    if args.report:
        from moeswarm_bench.bench.worker_real import _cpu_model, _kernels

        write_report(result, f"{_cpu_model()}, kernels {_kernels()} ({os.cpu_count()} CPUs, {platform.node()})")
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def kv_cache(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.kv_cache import run_kv_cache_bench, table_lines

    if args.model is None:
        from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
        from moeswarm_bench.bench.real_shapes import SHAPES

        args.model = str(model_file(SHAPES["olmoe"], DEFAULT_CACHE))
    result = run_kv_cache_bench(args.model, args.contexts, args.tokens, args.repeats, args.threads)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def fetch_slice(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.fetch_slice import report_lines, run_fetch_bench

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
