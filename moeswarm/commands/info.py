"""`moeswarm info`: what a model is (family, layers, experts, sizes, types) and how to split it."""

from __future__ import annotations

import argparse
import json

from moeswarm.commands._types import positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory (config.json + safetensors) or .gguf file, a slice file too "
                             "(default: the bundled model)")
    parser.add_argument("--workers", type=positive, default=2, metavar="N",
                        help="suggest an --experts split over N workers")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from moeswarm.bundled import demo_model
    from moeswarm.model.summary import summarize, summary_lines

    info = summarize(args.model or demo_model(), args.workers)
    print(json.dumps(info) if args.json else "\n".join(summary_lines(info)))
    return 0
