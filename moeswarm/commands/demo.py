"""`moeswarm demo`: the bundled model, two local workers, one streamed generation, checked (demo.py).

The bundled model is tiny (6.8 M parameters, trained for 27 minutes on Python source): greedy
decoding soon loops on it, so the demo samples from it (temperature 0.7, top-p 0.9, a fixed seed:
the same text every run), still checked against a local run with the same seed.
"""

from __future__ import annotations

import argparse
import json

from moeswarm.commands._setup import add_quiet, quiet_progress, set_threads
from moeswarm.commands._types import non_negative, positive, prompt_text, seed, temperature
from moeswarm.ids import format_ids


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
    from moeswarm.commands._generation_text import stream_text, summary_lines
    from moeswarm.demo import DemoOptions, run_demo

    options = DemoOptions(args.model, args.prompt, args.max_new_tokens, args.workers, args.speculate, args.temperature,
                          args.seed)  # checked: at least 2 workers
    # The backbone shares this machine with the workers: one thread each, or idle OpenMP
    # threads spinning here steal the workers' cores while the backbone waits for them.
    set_threads(1)
    if args.json:
        report = run_demo(options)
        print(json.dumps(report.to_json()))
    else:
        report = run_demo(options, on_start=_say_start, on_ready=lambda start: print(start.prompt, end="", flush=True),
                          on_event=stream_text)
        print()  # after the streamed text
        print("\n".join(summary_lines(report)))
    return 0 if report.result.bit_identical else 1


def _say_start(start) -> None:
    config = start.config
    if start.bundled:
        print(f"moeswarm demo: the bundled model, a {config.num_hidden_layers}-layer {config.model_type} with "
              f"{start.num_experts} experts per layer ({config.num_experts_per_tok} per token), 6.8 M "
              "parameters trained on Python source for half an hour: expect Python-looking text, not sense",
              flush=True)
    print(f"moeswarm demo: {config.model_type} from {start.model}; starting {len(start.expert_sets)} workers with experts "
          + ", ".join(format_ids(experts) for experts in start.expert_sets), flush=True)
