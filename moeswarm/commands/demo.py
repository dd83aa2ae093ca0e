"""`moeswarm demo`: the bundled model, two local workers, one streamed generation, checked.

The bundled model is tiny (6.8 M parameters, trained for 27 minutes on Python source): greedy
decoding soon loops on it, so the demo samples from it (temperature 0.7, top-p 0.9, a fixed seed:
the same text every run), still checked against a local run with the same seed.
"""

from __future__ import annotations

import argparse
import json

from moeswarm.bundled import DEMO_PROMPT, demo_model
from moeswarm.commands._generation_text import stream_text, summary_lines
from moeswarm.commands._setup import add_quiet, quiet_progress, set_threads
from moeswarm.commands._types import non_negative, positive, prompt_text, seed, temperature
from moeswarm.errors import MoeSwarmError
from moeswarm.generation.request import GenerationRequest
from moeswarm.generation.run import check_request, run_generation
from moeswarm.generation.sampling import SamplingParams
from moeswarm.ids import format_ids
from moeswarm.model.experts import num_experts_in_config
from moeswarm.model.source import open_source
from moeswarm.tools.local_workers import local_swarm, split_experts

BUNDLED_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "seed": 2}  # reads like Python on the bundled model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or .gguf file (default: the bundled model)")
    parser.add_argument("--prompt", type=prompt_text, default=None, help="prompt text (default: a Python function header)")
    parser.add_argument("--max-new-tokens", type=positive, default=48, help="most tokens to generate")
    parser.add_argument("--workers", type=int, default=2, help="number of local worker processes (>= 2)")
    parser.add_argument("--speculate", type=non_negative, default=0, metavar="K",
                        help="draft up to K tokens per step by n-gram lookup (0: off)")
    parser.add_argument("--temperature", type=temperature, default=None,
                        help="sampling temperature, 0 for greedy (default: 0.7 with top-p 0.9 on the bundled model, "
                             "greedy on a given --model)")
    parser.add_argument("--seed", type=seed, default=None, help="the sampling seed (default: 2, the same text every run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    if args.workers < 2:
        raise MoeSwarmError("the demo runs at least 2 workers")
    # The backbone shares this machine with the workers: one thread each, or idle OpenMP
    # threads spinning here steal the workers' cores while the backbone waits for them.
    set_threads(1)
    model = args.model or str(demo_model())
    source = open_source(model)
    config = source.config
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    bundled = args.model is None
    temperature = args.temperature if args.temperature is not None else (BUNDLED_SAMPLING["temperature"] if bundled else 0.0)
    sampling = SamplingParams(temperature, BUNDLED_SAMPLING["top_p"] if temperature else 1.0, 0,
                              args.seed if args.seed is not None else BUNDLED_SAMPLING["seed"])
    request = GenerationRequest(prompt, None, args.max_new_tokens, args.speculate, True, sampling=sampling)
    check_request(source, request)  # before any worker starts
    expert_sets = split_experts(num_experts_in_config(config), args.workers)
    if not args.json:
        if bundled:
            print(f"moeswarm demo: the bundled model, a {config.num_hidden_layers}-layer {config.model_type} with "
                  f"{num_experts_in_config(config)} experts per layer ({config.num_experts_per_tok} per token), 6.8 M "
                  "parameters trained on Python source for half an hour: expect Python-looking text, not sense",
                  flush=True)
        print(f"moeswarm demo: {config.model_type} from {model}; starting {args.workers} workers with experts "
              + ", ".join(format_ids(experts) for experts in expert_sets), flush=True)
    with local_swarm(model, expert_sets) as swarm:
        if not args.json:
            print(prompt, end="", flush=True)
        report = run_generation(swarm, request, on_event=None if args.json else stream_text)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print()  # after the streamed text
        print("\n".join(summary_lines(report)))
    return 0 if report.result.bit_identical else 1
