"""`moeswarm bench`: loopback overhead, PING under load, backbone memory, bytes on the wire, WAN."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from moeswarm.commands._setup import add_quiet
from moeswarm.commands._types import positive

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
    wan.add_argument("--scenarios", type=_scenarios, default=None, metavar="NAME[,NAME...]",
                     help="run only these scenarios (default: every one; names: see docs/bench.md)")
    wan.add_argument("--json", action="store_true", help="print {meta, rows} as JSON: every measured row")
    wan.add_argument("--out-json", metavar="FILE", default=None, help="also write {meta, rows} to FILE")
    wan.add_argument("--report", action="store_true", help="write docs/bench.md and its plots under docs/bench/")
    serve = sub.add_parser("serve", help="concurrent streaming clients against moeswarm serve, workers at 80 ms RTT (docs/serve.md)")
    serve.add_argument("--model", default=None,
                       help="model directory or file (default: the bundled model); 'real': the OLMoE-1B-7B-shaped "
                            "Q4_K_M file of `moeswarm bench real` (built and cached on first use), on 2 workers")
    serve.add_argument("--groups", type=_counts, default=(0,),
                       help="batches in flight to run, comma-separated (0: the server's own choice; default 0)")
    serve.add_argument("--workers", type=positive, default=None, help="worker processes (default: 4; 2 for --model real)")
    serve.add_argument("--quick", action="store_true", help="1, 2 and 4 clients and 12 tokens each, for smoke tests")
    serve.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default: 32, --quick 12)")
    serve.add_argument("--clients", type=_counts, default=None, help="comma-separated client counts (default: 1,2,4,8,16)")
    serve.add_argument("--speculate", type=_counts, default=(0, 4), help="draft limits to run, comma-separated")
    serve.add_argument("--serve-threads", type=int, default=1, help="torch threads of the serve process")
    serve.add_argument("--json", action="store_true", help=JSON_HELP)
    serve.add_argument("--report", action="store_true", help="write docs/serve.md and its plot under docs/serve/")
    from moeswarm.tools.bench.worker_real_shapes import DEFAULT_MODELS, DEFAULT_TYPES, QUANT_TYPES, SHAPES

    real = sub.add_parser("worker", help="one worker at real models' expert dimensions: start-up, RSS against hosted "
                                         "quantized bytes, expert compute per token vs llama.cpp (docs/bench-worker.md)")
    real.add_argument("--models", type=_names(*SHAPES), default=DEFAULT_MODELS,
                      help=f"layer shapes, comma-separated: {', '.join(SHAPES)} (default: {','.join(DEFAULT_MODELS)})")
    real.add_argument("--types", type=_names(*QUANT_TYPES), default=DEFAULT_TYPES,
                      help=f"quantization types, comma-separated: {', '.join(QUANT_TYPES)} (default: {','.join(DEFAULT_TYPES)})")
    real.add_argument("--threads", type=positive, default=1, help="threads of the worker and of llama.cpp (default 1)")
    real.add_argument("--cache-dir", default=None, metavar="DIR",
                      help="where the layer files are kept between runs (default ~/.cache/moeswarm/bench-worker)")
    real.add_argument("--quick", action="store_true", help="a tiny layer (d 256, 8 experts), for smoke tests")
    real.add_argument("--json", action="store_true", help="print {meta, rows} as JSON")
    add_quiet(real)
    from moeswarm.tools.bench.real_shapes import DEFAULT_SHAPES, SHAPES as MODEL_SHAPES

    whole = sub.add_parser("real", help="whole random models at real dimensions (OLMoE-1B-7B, Qwen3-30B-A3B) against "
                                        "llama.cpp on the same Q4_K_M file: local, 2 workers on loopback and at "
                                        "20/80 ms RTT (docs/bench-real.md)")
    whole.add_argument("--shapes", type=_names(*MODEL_SHAPES), default=None,
                       help=f"model shapes, comma-separated: {', '.join(MODEL_SHAPES)} (default: {','.join(DEFAULT_SHAPES)})")
    whole.add_argument("--threads", type=positive, default=2,
                       help="threads of llama.cpp, of moeswarm local and of the backbone; each worker gets half "
                            "(default 2)")
    whole.add_argument("--repeats", type=positive, default=5, help="alternating timed runs of each configuration (default 5)")
    whole.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="where the built model files are kept between runs (default ~/.cache/moeswarm/bench-real)")
    whole.add_argument("--quick", action="store_true", help="a tiny OLMoE-like model instead of --shapes, for smoke tests")
    whole.add_argument("--json", action="store_true", help="print {meta, rows} as JSON")
    whole.add_argument("--report", action="store_true", help="write docs/bench-real.md, docs/bench/real.png and real.json")
    add_quiet(whole)
    for bench in (loopback, memory, ping, wire, wan, serve):
        add_quiet(bench)
    fuzz = sub.add_parser("fuzz", help="fuzz a live worker: crashes, hangs, wrong replies, RSS (docs/protocol.md, Limits)")
    fuzz.add_argument("--cases", type=int, default=2000, help="fuzz cases to send (default 2000)")
    fuzz.add_argument("--seed", type=int, default=0, help="seed of the case generator (default 0)")
    fuzz.add_argument("--model", default=None, help="model directory (default: a tiny random qwen2_moe)")
    fuzz.add_argument("--json", action="store_true", help=JSON_HELP)
    flood = sub.add_parser("flood", help="a well-behaved client's latency before and during floods of a worker")
    flood.add_argument("--half-open", type=int, default=200, help="half-sent connections in that attack (default 200)")
    flood.add_argument("--flooders", type=int, default=4, help="pipelining connections that never read (default 4)")
    flood.add_argument("--samples", type=int, default=300, help="round trips timed per phase (default 300)")
    flood.add_argument("--amplification", action="store_true",
                       help="instead: the reply-amplification attack (big DISPATCHes, one expert, never read) and "
                            "the worker's RSS before, at peak and after")
    flood.add_argument("--handshakes", type=int, default=None, metavar="N",
                       help="instead: N silent connections to a keyed worker, and a keyed backbone's wait to greet it")
    flood.add_argument("--connections", type=int, default=256, help="attack connections (--amplification; default 256)")
    flood.add_argument("--tokens", type=int, default=8185, help="tokens per attack DISPATCH (default 8185: the largest RESULT a default worker admits at top-8, d 128)")
    flood.add_argument("--top-k", type=int, default=8, help="slots per token, all one expert (default 8)")
    flood.add_argument("--hold", type=float, default=40.0, help="seconds the attack is held (default 40)")
    flood.add_argument("--json", action="store_true", help=JSON_HELP)
    faults = sub.add_parser("faults", help="generations through WAN faults and SIGKILL with a replica of every expert, "
                                           "the tail with one slow worker, spot checks against a liar (docs/failover.md)")
    faults.add_argument("--generations", type=int, default=100, help="generations, one random fault each (default 100)")
    faults.add_argument("--parts", default="generations,tail,spot-checks,liars",
                        help="comma-separated parts to run: generations, tail, spot-checks, liars (default: all)")
    faults.add_argument("--liar-trials", type=int, default=3, help="trials per liar, check rate and holder count (default 3)")
    faults.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    faults.add_argument("--seed", type=int, default=0, help="seed of the faults drawn (default 0)")
    faults.add_argument("--json", action="store_true", help=JSON_HELP)
    relay = sub.add_parser("relay", help="time per layer call through a relay against direct, on loopback and at "
                                         "50 ms RTT, TLS on both (docs/network.md)")
    relay.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    relay.add_argument("--rtt-ms", type=float, default=50.0, help="the emulated WAN's round trip, both paths (default 50)")
    relay.add_argument("--steps", type=int, default=16, help="decode steps per path per repeat (default 16)")
    relay.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    relay.add_argument("--json", action="store_true", help=JSON_HELP)
    add_quiet(relay)
    discovery = sub.add_parser("discovery", help="workers joining and leaving a swarm on hivemind's DHT: seconds from "
                                                 "announcement to use, from kill or clean stop to drop (docs/discovery.md)")
    discovery.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    discovery.add_argument("--rounds", type=int, default=3, help="joins followed by a kill, and by a clean stop (default 3)")
    discovery.add_argument("--ttl", type=float, default=30.0, help="the workers' --announce-ttl in seconds (default 30)")
    discovery.add_argument("--poll", type=float, default=2.0, help="the backbone's DHT poll interval in seconds (default 2)")
    discovery.add_argument("--json", action="store_true", help=JSON_HELP)
    federation = sub.add_parser("federation", help="aggregate decode tokens/s of 1, 2 and 4 backbones sharing 4 workers "
                                                   "at 80 ms RTT, and the workers' merged calls (docs/federation.md)")
    federation.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    federation.add_argument("--new-tokens", type=int, default=16, help="tokens each backbone generates (default 16)")
    federation.add_argument("--wire", choices=("exact", "wan"), default="exact", help="wire preset (default exact)")
    federation.add_argument("--json", action="store_true", help=JSON_HELP)
    drafters = sub.add_parser("drafters", help="tokens per verify step of the model-free drafters (ngram, suffix) on "
                                                "held-out prompts and a file-editing workload (docs/drafts.md)")
    drafters.add_argument("--json", action="store_true", help=JSON_HELP)
    fetch = sub.add_parser("fetch-slice", help="fetch-slice throughput from a seeder on loopback and through a "
                                               "100 Mbit/s emulated link (docs/slices.md)")
    fetch.add_argument("--size-mb", type=float, default=64.0, help="expert bytes of the random GGUF model (default 64)")
    fetch.add_argument("--json", action="store_true", help=JSON_HELP)


def run(args: argparse.Namespace) -> int:
    from moeswarm.bundled import demo_model
    from moeswarm.commands._setup import quiet_progress, set_threads

    # Backbone and workers share this machine's cores: one thread each, or idle OpenMP threads
    # spinning in one process steal the others' time and the figures measure contention.
    set_threads(1)
    quiet_progress(args)

    if args.bench == "loopback":
        from moeswarm.tools.bench.loopback import run_loopback

        result = run_loopback(args.model or str(demo_model()), args.workers, args.steps, args.repeats)
        _print(result, args.json)
    elif args.bench == "ping":
        from moeswarm.tools.bench.ping_load import run_ping_under_load

        _print(run_ping_under_load(args.model or str(demo_model()), args.prefill_tokens), args.json)
    elif args.bench == "memory":
        from moeswarm.tools.bench.memory import MEMORY_MODEL, make_memory_model, run_memory, run_worker_memory
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
        from moeswarm.tools.bench.wire_bytes import (ALL_CONFIGS, MATCHED_CONFIGS, make_synthetic_model, model_bytes,
                                               synthetic_layer_bytes)
        from moeswarm.bundled import PYMOE

        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            synthetic = str(make_synthetic_model(Path(tmp) / "synthetic-3072"))
            rows += synthetic_layer_bytes(synthetic, 1, ALL_CONFIGS)  # every mode x codec pair
            rows += synthetic_layer_bytes(synthetic, 4, MATCHED_CONFIGS)
        rows += model_bytes(args.model or str(demo_model()), 2, label=args.model or f"{PYMOE.name} (bundled)")
        if args.json:
            print(json.dumps(rows))
        else:
            _table(rows)
    elif args.bench == "wan":
        _run_wan(args, args.model or str(demo_model()))
    elif args.bench == "serve":
        _run_serve(args, args.model or str(demo_model()))
    elif args.bench == "fuzz":
        from moeswarm.tools.bench.fuzz import run_fuzz

        _print(run_fuzz(args.cases, args.seed, args.model, progress=_fuzz_progress), args.json)
    elif args.bench == "flood":
        if args.handshakes is not None:
            from moeswarm.tools.bench.handshake_flood import run_handshake_flood

            _print(run_handshake_flood(args.handshakes), args.json)
        elif args.amplification:
            from moeswarm.tools.bench.amplification import run_amplification

            _print(run_amplification(args.connections, args.tokens, args.top_k, args.hold), args.json)
        else:
            from moeswarm.tools.bench.flood import run_flood

            _print(run_flood(args.half_open, args.flooders, args.samples), args.json)
    elif args.bench == "faults":
        from moeswarm.tools.bench.faults import print_report, run_faults

        result = run_faults(args.model or str(demo_model()), args.generations, tuple(args.parts.split(",")), args.seed,
                            args.liar_trials)
        print(json.dumps(result)) if args.json else print_report(result)
    elif args.bench == "worker":
        _run_worker(args)
    elif args.bench == "real":
        _run_real(args)
    elif args.bench == "relay":
        from moeswarm.tools.bench.relay import report_lines, run_relay_bench

        result = run_relay_bench(args.model or str(demo_model()), args.rtt_ms, args.steps, args.repeats)
        print(json.dumps(result)) if args.json else print("\n".join(report_lines(result)))
    elif args.bench == "discovery":
        from moeswarm.tools.bench.discovery import run_discovery

        _print(run_discovery(args.model or str(demo_model()), args.rounds, args.ttl, args.poll), args.json)
    elif args.bench == "federation":
        from moeswarm.tools.bench.federation import report_lines as federation_lines, run_federation

        result = run_federation(args.model or str(demo_model()), args.new_tokens, wire=args.wire)
        print(json.dumps(result)) if args.json else print("\n".join(federation_lines(result)))
    elif args.bench == "drafters":
        from moeswarm.tools.bench.drafters import run_drafters_bench, table_lines as drafter_lines

        result = run_drafters_bench()
        print(json.dumps(result)) if args.json else print("\n".join(drafter_lines(result)))
    elif args.bench == "fetch-slice":
        from moeswarm.tools.bench.fetch_slice import report_lines as fetch_lines, run_fetch_bench

        result = run_fetch_bench(args.size_mb)
        print(json.dumps(result)) if args.json else print("\n".join(fetch_lines(result)))
    return 0


def _run_wan(args: argparse.Namespace, model: str) -> None:
    from moeswarm.tools.bench.report import print_tables, write_report
    from moeswarm.tools.bench.wan_scenarios import run_wan

    result = run_wan(model, quick=args.quick, scenarios=args.scenarios)
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


def _run_serve(args: argparse.Namespace, model: str) -> None:
    import sys

    from moeswarm.tools.bench.serve_load import run_serve_bench, table_lines

    def show(row: dict) -> None:
        if sys.stderr.isatty() and not args.quiet:
            print(f"clients {row['clients']:>2} speculate {row['speculate']} groups {row['groups_flag'] or 'auto'}: "
                  f"{row['aggregate_tokens_per_s']:.2f} tokens/s", file=sys.stderr)

    workers = args.workers or 4
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


def _run_worker(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.worker_real import run_bench_worker
    from moeswarm.tools.bench.worker_real_gguf import DEFAULT_CACHE
    from moeswarm.tools.bench.worker_real_report import table_lines

    cache = Path(args.cache_dir).expanduser() if args.cache_dir else DEFAULT_CACHE
    result = run_bench_worker(args.models, args.types, cache, args.threads, args.quick)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))


def _run_real(args: argparse.Namespace) -> None:
    from moeswarm.tools.bench.real_build import DEFAULT_CACHE
    from moeswarm.tools.bench.real_measure import run_bench_real
    from moeswarm.tools.bench.real_report import table_lines, write_report

    from moeswarm.tools.bench.real_shapes import DEFAULT_SHAPES
    from moeswarm.errors import MoeSwarmError

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


def _names(*known: str):
    """argparse type: a comma-separated list of some of `known`."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)} separated by commas, got {text!r}")
        return names

    return parse


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"counts must not be negative, got {text!r}")
    return counts


def _fuzz_progress(done: int, counts: dict) -> None:
    import sys

    print(f"fuzz: {done} cases, findings {counts or 'none'}", file=sys.stderr, flush=True)


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


def _scenarios(text: str) -> tuple[str, ...]:
    """argparse type of `bench wan --scenarios`: names of its scenarios, comma-separated."""
    from moeswarm.tools.bench.wan_scenarios import scenario_names

    return _names(*scenario_names())(text)
