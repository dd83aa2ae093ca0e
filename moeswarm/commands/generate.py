"""`moeswarm generate`: a backbone here, experts on remote workers (or, with none, here too: the local mode)."""

from __future__ import annotations

import argparse
import json

from moeswarm.commands._setup import add_backbone_dtype, add_quiet, apply_backbone_dtype
from moeswarm.commands._local import add_local_experts
from moeswarm.commands._swarm import add_backbone_swarm, check_workers_or_swarm, discovery_options
from moeswarm.commands._types import fraction, non_negative, positive, prompt_file, prompt_text, seconds, seed, stop_string, temperature, top_p
from moeswarm.commands._tls import add_swarm_key, client_tls
from moeswarm.generation.draft_names import DRAFTERS, check_draft_flags
from moeswarm.transport import FANOUTS
from moeswarm.wire.config import COMBINE_MODES, PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json + safetensors) or GGUF file (.gguf)")
    parser.add_argument("--workers", default=None, type=_workers,
                        help="comma-separated workers: HOST:PORT, relay://RELAY:PORT/NAME (a worker behind NAT), "
                             "or HOST:PORT+relay://RELAY:PORT/NAME (direct if it answers, else the relay); "
                             "none (and no --swarm): the local mode, every expert in this process")
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
    parser.add_argument("--speculate", type=non_negative, default=0, metavar="K",
                        help="draft up to K tokens per step, verified in one forward (0: off)")
    parser.add_argument("--draft", choices=DRAFTERS, default="ngram",
                        help="where --speculate's drafts come from: ngram (prompt lookup), local (the backbone with "
                             "only its --local-experts, no round trip; adaptive length), both (n-gram on a match of "
                             "2+ tokens, else local); the output is the same whichever")
    parser.add_argument("--check-local", action="store_true",
                        help="also run the model locally (eager) on the same tokens and compare every step: "
                             "torch.equal logits on an exact wire, the gate's argmax/cosine thresholds on a lossy one")
    parser.add_argument("--fanout", choices=FANOUTS, default="star",
                        help="star: send every worker its share before awaiting any reply; chain: one worker after another")
    parser.add_argument("--wire", choices=tuple(PRESETS), default="exact",
                        help="preset: exact (bit-identical, lossless) or wan (the gated cheap wire: partial sums, "
                             "int8 blockwise both ways; docs/wire.md); the flags below override it")
    parser.add_argument("--combine", choices=COMBINE_MODES, default=None,
                        help="exact: per-expert outputs, bit-identical; partial: one weighted sum per token per worker "
                             "(default: the preset's)")
    parser.add_argument("--wire-dispatch", default=None, help="codec for hidden states (default: the preset's)")
    parser.add_argument("--wire-combine", default=None, help="codec for the experts' outputs (default: the preset's)")
    parser.add_argument("--threads", type=positive, default=None,
                        help="CPU threads of the backbone, torch's and the kernels' (default: every core: the backbone and its workers take turns)")
    parser.add_argument("--reply-timeout", type=seconds, default=120.0, metavar="SECONDS",
                        help="the most any worker's reply is awaited; measured deadlines are shorter (docs/failover.md)")
    parser.add_argument("--no-hedge", action="store_true",
                        help="never send a late share's duplicate to a replica of its experts")
    parser.add_argument("--spot-check", type=fraction, default=0.0, metavar="FRACTION",
                        help="recompute this fraction of remote answers on another holder; ban a liar (0: off)")
    add_local_experts(parser)
    add_backbone_swarm(parser)
    add_swarm_key(parser)
    add_backbone_dtype(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from moeswarm.commands._setup import quiet_progress

    quiet_progress(args)
    check_workers_or_swarm(args)
    from moeswarm.commands._setup import set_backbone_threads
    from moeswarm.commands._local import resolve as resolve_local_experts
    from moeswarm.generation.run import GenerationRequest, check_request, run_generation, summary_lines
    from moeswarm.generation.sampling import SamplingParams
    from moeswarm.model.source import open_source
    from moeswarm.swarm import open_swarm
    from moeswarm.wire.config import WireConfig

    wire = WireConfig.from_flags(args.wire, args.combine, args.wire_dispatch, args.wire_combine)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    request = GenerationRequest(args.prompt, args.prompt_ids, args.max_new_tokens, args.speculate,
                                args.check_local, stream=not args.json, sampling=sampling, stops=tuple(args.stop),
                                draft=args.draft)
    source = open_source(args.model)
    check_request(source, request)  # before the backbone loads or a worker is reached
    local_experts = resolve_local_experts(args, source)
    check_draft_flags(args.draft, args.speculate, local_experts is not None)
    set_backbone_threads(args.threads)
    tls = client_tls(args.swarm_key)
    apply_backbone_dtype(args)
    with open_swarm(source, args.workers or [], wire, args.fanout, reply_timeout_s=args.reply_timeout,
                    hedge=not args.no_hedge, spot_check=args.spot_check, tls=tls, local_experts=local_experts,
                    discovery=discovery_options(args)) as swarm:
        report = run_generation(swarm, request)
        report["worker_paths"] = swarm.accounting()["worker_paths"]  # "direct" or "relay" per worker
        report["routing"] = swarm.routing_stats().summary()
        report["trip_share"] = swarm.accounting()["trip_share"]  # (token, layer) pairs that went to a remote holder
        report["local_experts"] = {str(layer): list(experts) for layer, experts in swarm.local_held().items()}
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(summary_lines(report)))
    return 0 if report["check_passed"] is not False else 1


def _workers(text: str) -> list[str]:
    from moeswarm.net.path import parse_worker

    workers = [w.strip() for w in text.split(",") if w.strip()]
    try:
        for worker in workers:
            parse_worker(worker)  # HOST:PORT, relay://RELAY:PORT/NAME, or both joined by + (docs/network.md)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not workers:
        raise argparse.ArgumentTypeError("empty worker list")
    return workers


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad token id list {text!r}: expected integers separated by commas") from None
