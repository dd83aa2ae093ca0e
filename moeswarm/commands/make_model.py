"""`moeswarm make-model`: write a tiny random MoE model of a family."""

from __future__ import annotations

import argparse

from moeswarm.errors import MoeSwarmError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", required=True, help="model family, e.g. qwen3_moe (see docs/models.md)")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def run(args: argparse.Namespace) -> int:
    from moeswarm.sources.summary import summarize, summary_lines
    from moeswarm.model.tiny import EXTRA_FAMILIES, FAMILIES, make_tiny_model

    if args.family not in FAMILIES and args.family not in EXTRA_FAMILIES:
        raise MoeSwarmError(f"unknown family {args.family!r}; known: {', '.join(sorted({**FAMILIES, **EXTRA_FAMILIES}))}")
    path = make_tiny_model(args.family, args.out, args.seed)
    print(f"wrote a tiny {args.family} model to {path}")
    print("\n".join(summary_lines(summarize(path))))
    return 0
