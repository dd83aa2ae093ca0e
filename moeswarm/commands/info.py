"""`moeswarm info`: what a model is (family, layers, experts, sizes, types) and how to split it.

For a GGUF file it also names the architecture's support status (gguf/gguf_support.py) and the
per-model gate to run before serving it over a lossy wire; an unsupported architecture's error
lists the supported ones and points to docs/models.md.
"""

from __future__ import annotations

import argparse
import json

from moeswarm.bundled import demo_model
from moeswarm.commands._types import positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory (config.json + safetensors) or .gguf file, a slice file too "
                             "(default: the bundled model)")
    parser.add_argument("--workers", type=positive, default=2, metavar="N",
                        help="suggest an --experts split over N workers")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from moeswarm.sources.describe import describe_model, summary_lines

    info = describe_model(args.model or demo_model(), args.workers)
    lines = summary_lines(info)
    if "gguf_architecture" in info:
        lines[1:1] = [f"  GGUF architecture   {info['gguf_architecture']}: {info['gguf_support']}"]
        lines.append(f"  gate before serving over a lossy wire:\n    {info['gate_command']}")
    print(json.dumps(info) if args.json else "\n".join(lines))
    return 0
