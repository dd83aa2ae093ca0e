"""`moeswarm profile`: count a model's routing over calibration prompts and write a routing profile.

The whole model runs here (no workers); the profile ranks each layer's experts for
`--local-experts N|P% --profile PROFILE.json` on generate and serve.
"""

from __future__ import annotations

import argparse
import json

from moeswarm.commands._setup import add_quiet
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
    from moeswarm.commands._setup import quiet_progress, set_threads

    quiet_progress(args)
    from moeswarm.bundled import PROMPTS, demo_model
    from moeswarm.errors import MoeSwarmError
    from moeswarm.model.calibrate import count_routing, read_prompts
    from moeswarm.model.experts import num_experts_in_config
    from moeswarm.model.loading import load_local
    from moeswarm.model.source import open_source
    from moeswarm.model.tokenizer import load_text_codec
    from moeswarm.placement.profile import RoutingStats

    source = open_source(args.model or demo_model())
    if args.prompts is None and not PROMPTS.is_file():
        raise MoeSwarmError(f"no bundled prompts at {PROMPTS}: give --prompts FILE")
    texts = read_prompts(args.prompts or PROMPTS)
    if not texts:
        raise MoeSwarmError(f"{args.prompts}: no prompts in it")
    config = source.config
    codec = load_text_codec(source, config.vocab_size)
    limit = min(args.max_tokens, getattr(config, "max_position_embeddings", None) or args.max_tokens)
    prompts = [codec.encode(text)[:limit] for text in texts]
    set_threads(args.threads)
    stats = RoutingStats(num_experts_in_config(config), source.fingerprint, config.model_type)
    count_routing(load_local(source), prompts, stats)
    try:
        with open(args.output, "w") as out:
            json.dump(stats.to_json(), out)
    except OSError as error:
        raise MoeSwarmError(f"cannot write {args.output}: {error.strerror or error}") from None
    tokens = sum(len(p) for p in prompts)
    print(f"routing profile of {len(prompts)} prompts, {tokens} tokens, {len(stats.layers)} MoE layers -> {args.output}")
    return 0
