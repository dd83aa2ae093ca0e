"""Each benchmark's flags (`moeswarm bench NAME --help`): one function per benchmark, named in
moeswarm_bench/commands/bench.py's table."""

from __future__ import annotations

import argparse

from moeswarm.commands._types import positive
from moeswarm_bench.bench import real_shapes, worker_real_shapes

JSON_HELP = "print JSON instead of text"


def loopback(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--workers", type=int, default=2, help="number of local worker processes")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs, local and remote each")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-model", action="append", default=[], metavar="PATH",
                        help="also measure workers (a quarter vs all experts) on this model directory or .gguf")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def ping(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled model)")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="tokens in each prefill DISPATCH that loads the worker")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def wire_bytes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def wan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--quick", action="store_true", help="a reduced run, for smoke tests")
    parser.add_argument("--scenarios", type=_scenarios, default=None, metavar="NAME[,NAME...]",
                        help="run only these scenarios (default: every one; names: see docs/bench.md)")
    parser.add_argument("--json", action="store_true", help="print {meta, rows} as JSON: every measured row")
    parser.add_argument("--out-json", metavar="FILE", default=None, help="also write {meta, rows} to FILE")
    parser.add_argument("--report", action="store_true", help="write docs/bench.md and its plots under docs/bench/")


def serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model directory or file (default: the bundled model); 'real': the OLMoE-1B-7B-shaped "
                             "Q4_K_M file of `moeswarm bench real` (built and cached on first use), on 2 workers")
    parser.add_argument("--groups", type=counts, default=(0,),
                        help="batches in flight to run, comma-separated (0: the server's own choice; default 0)")
    parser.add_argument("--workers", type=positive, default=None, help="worker processes (default: 4; 2 for --model real)")
    parser.add_argument("--quick", action="store_true", help="1, 2 and 4 clients and 12 tokens each, for smoke tests")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default: 32, --quick 12)")
    parser.add_argument("--clients", type=counts, default=None, help="comma-separated client counts (default: 1,4,16,64)")
    parser.add_argument("--speculate", type=counts, default=(0, 4), help="draft limits to run, comma-separated")
    parser.add_argument("--serve-threads", type=int, default=1, help="torch threads of the serve process")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)
    parser.add_argument("--report", action="store_true", help="write docs/serve.md and its plot under docs/serve/")


def worker(parser: argparse.ArgumentParser) -> None:
    shapes, quant_types = worker_real_shapes.SHAPES, worker_real_shapes.QUANT_TYPES
    default_models, default_types = worker_real_shapes.DEFAULT_MODELS, worker_real_shapes.DEFAULT_TYPES
    parser.add_argument("--models", type=names(*shapes), default=default_models,
                        help=f"layer shapes, comma-separated: {', '.join(shapes)} (default: {','.join(default_models)})")
    parser.add_argument("--types", type=names(*quant_types), default=default_types,
                        help=f"quantization types, comma-separated: {', '.join(quant_types)} "
                             f"(default: {','.join(default_types)})")
    parser.add_argument("--threads", type=positive, default=1, help="threads of the worker and of llama.cpp (default 1)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="where the layer files are kept between runs (default ~/.cache/moeswarm/bench-worker)")
    parser.add_argument("--quick", action="store_true", help="a tiny layer (d 256, 8 experts), for smoke tests")
    parser.add_argument("--json", action="store_true", help="print {meta, rows} as JSON")


def real(parser: argparse.ArgumentParser) -> None:
    shapes = real_shapes.SHAPES
    parser.add_argument("--shapes", type=names(*shapes), default=None,
                        help=f"model shapes, comma-separated: {', '.join(shapes)} "
                             f"(default: {','.join(real_shapes.DEFAULT_SHAPES)})")
    parser.add_argument("--threads", type=positive, default=2,
                        help="threads of llama.cpp, of moeswarm local and of the backbone; each worker gets half "
                             "(default 2)")
    parser.add_argument("--repeats", type=positive, default=5, help="alternating timed runs of each configuration (default 5)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="where the built model files are kept between runs (default ~/.cache/moeswarm/bench-real)")
    parser.add_argument("--quick", action="store_true", help="a tiny OLMoE-like model instead of --shapes, for smoke tests")
    parser.add_argument("--json", action="store_true", help="print {meta, rows} as JSON")
    parser.add_argument("--report", action="store_true", help="write docs/bench-real.md, docs/bench/real.png and real.json")


def products(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="GGUF file with attn_q/k/v/output, output.weight and ffn_*_exps tensors (default: the "
                             "OLMoE-shaped Q4_K_M file of `bench real`, built first if missing)")
    parser.add_argument("--repeats", type=positive, default=30, help="timed passes per figure (default 30)")
    parser.add_argument("--against", choices=("ggml",), default=None,
                        help="ggml: time the same cold one-row products, one thread, through ggml as llama-cpp-python "
                             "ships it, with plain buffers and each extra buffer type (AMX, CPU_REPACK) its CPU has, "
                             "each side in a child process (a crash is a row), alternating rounds")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def fuzz(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=int, default=2000, help="fuzz cases to send (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case generator (default 0)")
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random qwen2_moe); with "
                                                      "--files, the GGUF file to mutate (default: the bundled Q4_K_M)")
    parser.add_argument("--files", type=int, default=None, metavar="N",
                        help="instead: N mutated GGUF files through info, slice, worker and generate, each a forked "
                             "process under a deadline and an RSS cap (crashes, hangs, tracebacks; docs/gguf.md)")
    parser.add_argument("--commands", default="info,slice,worker,generate", help="with --files: the commands to run")
    parser.add_argument("--timeout", type=float, default=60.0, help="with --files: seconds a run may take")
    parser.add_argument("--rss-cap-mb", type=float, default=3000.0, help="with --files: MB of RSS a run may reach")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def flood(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--half-open", type=int, default=200, help="half-sent connections in that attack (default 200)")
    parser.add_argument("--flooders", type=int, default=4, help="pipelining connections that never read (default 4)")
    parser.add_argument("--samples", type=int, default=300, help="round trips timed per phase (default 300)")
    parser.add_argument("--amplification", action="store_true",
                        help="instead: the reply-amplification attack (big DISPATCHes, one expert, never read) and "
                             "the worker's RSS before, at peak and after")
    parser.add_argument("--handshakes", type=int, default=None, metavar="N",
                        help="instead: N silent connections to a keyed worker, and a keyed backbone's wait to greet it")
    parser.add_argument("--stage", action="store_true",
                        help="instead: issue 62's attacks on a `moeswarm stage` (copies, new sequences, respelled next "
                             "stages, a non-reader, silent connections) and an honest gateway's steps through them")
    parser.add_argument("--connections", type=int, default=256, help="attack connections (--amplification; default 256)")
    parser.add_argument("--tokens", type=int, default=8185,
                        help="tokens per attack DISPATCH (default 8185: the largest RESULT a default worker admits "
                             "at top-8, d 128)")
    parser.add_argument("--top-k", type=int, default=8, help="slots per token, all one expert (default 8)")
    parser.add_argument("--hold", type=float, default=40.0, help="seconds the attack is held (default 40)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def faults(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--generations", type=int, default=100, help="generations, one random fault each (default 100)")
    parser.add_argument("--parts", default="generations,tail,spot-checks,liars",
                        help="comma-separated parts to run: generations, tail, spot-checks, liars (default: all)")
    parser.add_argument("--liar-trials", type=int, default=3, help="trials per liar, check rate and holder count (default 3)")
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults drawn (default 0)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def relay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--rtt-ms", type=float, default=50.0, help="the emulated WAN's round trip, both paths (default 50)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per path per repeat (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def discovery(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--rounds", type=int, default=3, help="joins followed by a kill, and by a clean stop (default 3)")
    parser.add_argument("--ttl", type=float, default=30.0, help="the workers' --announce-ttl in seconds (default 30)")
    parser.add_argument("--poll", type=float, default=2.0, help="the backbone's DHT poll interval in seconds (default 2)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def federation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens each backbone generates (default 16)")
    parser.add_argument("--wire", choices=("exact", "wan"), default="exact", help="wire preset (default exact)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def json_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def drafters(parser: argparse.ArgumentParser) -> None:
    from moeswarm_bench.commands.bench_islands import _rtts

    parser.add_argument("--rtts", type=_rtts, default=None, metavar="MS,...",
                        help="run over emulated links at these RTTs (e.g. 5,20,50): the default speculation against "
                             "--speculate 0 and fixed K, star and 2 islands (without it: the drafters' replay)")
    parser.add_argument("--model", default=None,
                        help="with --rtts: a model directory or GGUF file (default: the real-dimension OLMoE-shaped "
                             "file of `bench real`, built and cached on first use; 'bundled': the bundled model)")
    parser.add_argument("--tokens", type=positive, default=32, help="with --rtts: tokens per run (default 32)")
    parser.add_argument("--fixed", type=counts, default=(2, 4, 8), help="with --rtts: fixed K runs (default 2,4,8)")
    parser.add_argument("--topologies", type=names("star", "islands"), default=("star", "islands"),
                        help="with --rtts: star, islands or both (default both)")
    parser.add_argument("--repeats", type=positive, default=1,
                        help="with --rtts: runs of each configuration, taking turns; a row is the median run (default 1)")
    parser.add_argument("--report", action="store_true", help="with --rtts: write docs/bench-drafters.md")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def kv_cache(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="GGUF file or model directory (default: the OLMoE-shaped Q4_K_M file of `bench real`, built "
                             "first if missing)")
    parser.add_argument("--contexts", type=_positive_ints, default=(256, 2048), metavar="N,...",
                        help="context lengths, in tokens (default 256,2048)")
    parser.add_argument("--tokens", type=positive, default=16, help="greedy decode steps a run (default 16)")
    parser.add_argument("--repeats", type=positive, default=3, help="runs a cache and context, alternating (default 3)")
    parser.add_argument("--threads", type=positive, default=2, help="torch and kernel threads (default 2)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def _positive_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(t) for t in text.split(",") if t.strip().isdigit())
    if not values or len(values) != len([t for t in text.split(",") if t.strip()]) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive whole numbers, comma-separated, like 256,2048")
    return values


def fetch_slice(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=float, default=64.0, help="expert bytes of the random GGUF model (default 64)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def names(*known: str):
    """argparse type: a comma-separated list of some of `known`."""
    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in chosen if n not in known]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)} separated by commas, got {text!r}")
        return chosen

    return parse


def counts(text: str) -> tuple[int, ...]:
    """argparse type: non-negative integers, comma-separated."""
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if any(c < 0 for c in values):
        raise argparse.ArgumentTypeError(f"counts must not be negative, got {text!r}")
    return values


def _scenarios(text: str) -> tuple[str, ...]:
    """argparse type of `bench wan --scenarios`: names of its scenarios, comma-separated."""
    from moeswarm_bench.bench.wan_scenarios import scenario_names

    return names(*scenario_names())(text)
