"""`moeswarm bench islands`'s flags and run (a row of moeswarm_bench/commands/bench.py's table)."""

from __future__ import annotations

import argparse
import json

from moeswarm.commands._types import non_negative, positive


def _rtts(text: str) -> tuple[float, ...]:
    try:
        rtts = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rtts {text!r}: milliseconds, comma-separated, like 20,50,100") from None
    if not rtts or any(r < 0 for r in rtts):
        raise argparse.ArgumentTypeError(f"--rtts {text!r}: milliseconds >= 0, comma-separated")
    return rtts


def _counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(t) for t in text.split(",") if t.strip().isdigit())
    if not counts or any(c not in (1, 2, 4) for c in counts):
        raise argparse.ArgumentTypeError(f"--stages {text!r}: some of 1,2,4")
    return counts


def flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rtts", type=_rtts, default=(20.0, 50.0, 100.0), metavar="MS,...",
                        help="RTTs of the emulated links, in ms (default 20,50,100)")
    parser.add_argument("--stages", type=_counts, default=(1, 2, 4), metavar="N,...",
                        help="chains of this many stages, some of 1,2,4, each run twice: islands (each stage "
                             "with a worker on loopback) and a layer split (each stage holding its experts) "
                             "(default all three)")
    parser.add_argument("--tokens", type=positive, default=8, help="greedy tokens decoded per run (default 8)")
    parser.add_argument("--speculate", type=non_negative, default=4,
                        help="drafts per step in the runs with drafts (suffix drafts; 0: no such runs) (default 4)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--report", action="store_true", help="write docs/bench-islands.md and its plot")


def run(args: argparse.Namespace) -> None:
    from moeswarm_bench.bench.islands_bench import run_islands_bench, table_lines

    result = run_islands_bench(args.rtts, args.stages, args.tokens, args.speculate, report=args.report)
    print(json.dumps(result) if args.json else "\n".join(table_lines(result)))
