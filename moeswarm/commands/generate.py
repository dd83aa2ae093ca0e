"""`moeswarm generate`: a backbone here, experts on remote workers (or, with none, here too: the local mode)."""

from __future__ import annotations

import argparse
import json

from moeswarm.commands._setup import add_quiet, quiet_progress, set_backbone_threads
from moeswarm.commands._stages import add_stages, open_backbone
from moeswarm.commands._swarm import check_workers_or_swarm, model_from_swarm
from moeswarm.commands._swarm_flags import add_swarm_flags, swarm_config
from moeswarm.commands._types import non_negative, positive, prompt_file, prompt_text, seed, stop_string, temperature, top_p
from moeswarm.commands._speculate import add_speculate
from moeswarm.generation.draft_names import DEFAULT_DRAFT, DRAFTERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
        help="model directory (config.json + safetensors) or GGUF file (.gguf); with --swarm INVITE it may be left out: "
             "the backbone (every tensor but the routed experts) is fetched from the invite's seeder into ~/.cache/moeswarm/join, "
             "the whole model with --check-local")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", type=prompt_text, help="prompt text (-: read it from standard input)")
    prompt.add_argument("--prompt-file", type=prompt_file, metavar="FILE", dest="prompt",
                        help="read the prompt from FILE, verbatim (-: standard input)")
    prompt.add_argument("--prompt-ids", type=_ids, help="prompt as comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=positive, default=32, help="most tokens to generate")
    parser.add_argument("--temperature", type=temperature, default=0.0,
                        help="sampling temperature; 0: greedy (the argmax, no randomness)")
    parser.add_argument("--top-p", type=top_p, default=1.0,
                        help="sample from the fewest most likely tokens whose probability reaches P (1: off)")
    parser.add_argument("--top-k", type=non_negative, default=0, help="sample from the K most likely tokens (0: off)")
    parser.add_argument("--seed", type=seed, default=None,
                        help="random seed for sampling: the same seed gives the same tokens (default: a fresh one, "
                             "shown in the report)")
    parser.add_argument("--stop", type=stop_string, action="append", default=[], metavar="STR",
                        help="end the generation where STR appears (STR itself is not printed); repeatable")
    add_speculate(parser.add_argument, "step")
    parser.add_argument("--draft", choices=DRAFTERS, default=DEFAULT_DRAFT,
                        help="where --speculate's drafts come from: ngram (prompt lookup), suffix (the longest earlier match in this and recent requests), local (the backbone with "
                             "only its --local-experts, no round trip; adaptive length), both (n-gram on a match of "
                             "2+ tokens, else local); the output is the same whichever")
    parser.add_argument("--check-local", action="store_true",
                        help="also run the model locally (eager) on the same tokens and compare every step: "
                             "torch.equal logits on an exact wire, the gate's argmax/cosine thresholds on a lossy one")
    add_swarm_flags(parser)
    add_stages(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    check_workers_or_swarm(args)
    model_from_swarm(args)
    from moeswarm.commands._generation_text import stream_text, summary_lines
    from moeswarm.engine.from_model import GenerationRequest, SamplingParams, generate_from_model

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    request = GenerationRequest(args.prompt, args.prompt_ids, args.max_new_tokens, args.speculate,
                                args.check_local, sampling=sampling, stops=tuple(args.stop), draft=args.draft,
                                speculate_policy=args.speculate_policy)
    report = generate_from_model(args.model, request, lambda source: swarm_config(args, source),
                                 _opener(args), args.backbone_dtype,
                                 on_event=None if args.json else stream_text)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print()  # after the streamed text
        print("\n".join(summary_lines(report)))
    return 0 if report.check_passed is not False else 1


def _opener(args: argparse.Namespace):
    """Opens the backbone once the request and the flags are checked: this process's threads first."""
    def open_checked(source, config):
        set_backbone_threads(args.threads)
        return open_backbone(source, args, config)

    return open_checked


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad token id list {text!r}: expected integers separated by commas") from None
