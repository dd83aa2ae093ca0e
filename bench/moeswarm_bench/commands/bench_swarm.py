"""`moeswarm bench swarm`'s flags and run (a row of moeswarm_bench/commands/bench.py's table)."""

from __future__ import annotations

import argparse
import json
import sys

from moeswarm.commands._types import non_negative, positive, seconds


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--joiners {text!r}: counts of joiners, comma-separated, like 2,4,8") from None
    if not counts or any(not 1 <= c <= 32 for c in counts):
        raise argparse.ArgumentTypeError(f"--joiners {text!r}: counts from 1 to 32, comma-separated")
    return counts


def flags(parser: argparse.ArgumentParser) -> None:
    from moeswarm_bench.bench.swarm_settings import JOINERS, KILLS, REBALANCE_S, REPLICAS, SEGMENT_TOKENS, TTL_S

    parser.add_argument("--joiners", type=_counts, default=JOINERS, metavar="N,...",
                        help=f"swarms of this many `moeswarm join` processes, one after another "
                             f"(default {','.join(map(str, JOINERS))})")
    parser.add_argument("--kills", type=non_negative, default=KILLS, metavar="K",
                        help=f"random joiners killed (SIGKILL) and started again while the stream runs (default {KILLS})")
    parser.add_argument("--model", default="bundled", metavar="bundled|olmoe|PATH",
                        help="the GGUF file the invite seeds: the bundled model, the real-dimension OLMoE-shaped file "
                             "of `bench real` (built when its cache lacks it), or a file (default bundled)")
    parser.add_argument("--replicas", type=positive, default=REPLICAS, metavar="R",
                        help=f"each joiner's --memory holds ceil(R x experts / N) experts: every expert R times once "
                             f"all have joined (default {REPLICAS}: one member may leave without uncovering any)")
    parser.add_argument("--rejoin", choices=["expiry", "now"], default="expiry",
                        help="a killed joiner starts again once its record expired (expiry, default), or at once (now: "
                             "it sees its stale record, and rebalancing repairs its share)")
    parser.add_argument("--ttl", type=seconds, default=TTL_S, metavar="SECONDS",
                        help=f"every joiner's --announce-ttl: a killed joiner's record lasts this long (default "
                             f"{TTL_S:g}; `moeswarm join`'s own default is 30)")
    parser.add_argument("--rebalance", type=seconds, default=REBALANCE_S, metavar="SECONDS",
                        help=f"every joiner's --rebalance period (default {REBALANCE_S:g})")
    parser.add_argument("--segment-tokens", type=positive, default=SEGMENT_TOKENS, metavar="T",
                        help=f"the stream decodes the same prompt again and again, T tokens each time, within the "
                             f"model's positions (default {SEGMENT_TOKENS})")
    parser.add_argument("--seed", type=non_negative, default=0, help="draws which joiners are killed (default 0)")
    parser.add_argument("--keyed", action="store_true",
                        help="a keyed swarm: a swarm key, a member file for the inviter, each joiner and the stream "
                             "(TLS on every link, signed records)")
    parser.add_argument("--check-local", action="store_true",
                        help="also compare every forward's logits of the stream with the local eager model's "
                             "(torch.equal; a local forward per step: fewer tokens/s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--report", action="store_true", help="write docs/bench-swarm.md and docs/bench/swarm.json")


def run(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.swarm_bench import run_swarm_bench
    from moeswarm_bench.bench.swarm_lines import table_lines
    from moeswarm_bench.bench.swarm_settings import Settings

    settings = Settings(args.joiners, args.kills, args.replicas, args.seed, args.ttl, args.rebalance, rejoin=args.rejoin,
                        segment_tokens=args.segment_tokens, keyed=args.keyed, check_local=args.check_local)

    def say(line: str) -> None:
        if not args.quiet:
            print(f"moeswarm bench swarm: {line}", file=sys.stderr, flush=True)

    result = run_swarm_bench(args.model, settings, report=args.report, say=say)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))
