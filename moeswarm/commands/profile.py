"""`moeswarm profile`: count a model's routing over calibration prompts and write a routing profile.

The whole model runs here (no workers); the profile ranks each layer's experts for
`--local-experts N|P% --profile PROFILE.json` on generate and serve.
"""

from __future__ import annotations

import argparse

from moeswarm.commands._setup import add_quiet, quiet_progress, set_threads
from moeswarm.commands._types import positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or GGUF file (default: the bundled model)")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="calibration prompts: JSON lines with a \"text\" field, or one prompt per line "
                             "(default: the bundled model's prompts, models/pymoe/prompts.jsonl)")
    parser.add_argument("--max-tokens", type=positive, default=256,
                        help="tokens of each prompt fed (fewer when the model has fewer positions)")
    parser.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where to write the profile")
    parser.add_argument("--threads", type=positive, default=None, help="torch CPU threads (default: shared fairly)")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    from moeswarm.placement.routing_profile import write_routing_profile

    written = write_routing_profile(args.output, args.model, args.prompts, args.max_tokens,
                                    before_load=lambda: set_threads(args.threads))
    print(f"routing profile of {written.prompts} prompts, {written.tokens} tokens, {written.moe_layers} MoE layers "
          f"-> {written.path}")
    return 0
