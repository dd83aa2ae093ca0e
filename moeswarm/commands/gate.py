"""`moeswarm gate`: argmax agreement and logit cosine of a wire configuration against exact local."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from moeswarm.bundled import PROMPTS, demo_model
from moeswarm.commands._setup import add_quiet, quiet_progress, set_threads
from moeswarm.wire.codecs import FLOAT_CODECS
from moeswarm.wire.config import COMBINE_MODES, WireConfig

if TYPE_CHECKING:
    from moeswarm.gate import GateReport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled model)")
    parser.add_argument("--combine", choices=COMBINE_MODES, default="partial",
                        help="exact: per-expert outputs; partial: one weighted sum per token per worker")
    parser.add_argument("--wire-dispatch", default=None, help="codec for hidden states (default: lossless)")
    parser.add_argument("--wire-combine", default=None, help="codec for the experts' outputs (default: lossless)")
    parser.add_argument("--reference", default="local",
                        help="'local' (the model's own weights) or FILE.gguf: both sides run on that file's weights")
    parser.add_argument("--prompts", default=None, help="JSONL ({\"text\": ...}) or text file (default: bundled held-out prompts)")
    parser.add_argument("--min-argmax", type=float, default=0.99, help="minimum top-1 agreement (default 0.99)")
    parser.add_argument("--min-cosine", type=float, default=0.998, help="minimum mean logit cosine (default 0.998)")
    parser.add_argument("--workers", type=int, default=2, help="number of local worker processes")
    parser.add_argument("--matrix", action="store_true",
                        help="gate every combine mode x codec pair (same codec both ways) and print them all")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    wire = WireConfig(args.combine, args.wire_dispatch, args.wire_combine)  # checked before anything loads
    set_threads(1)
    quiet_progress(args)
    from moeswarm.gate import GateConfig, load_prompts, run_gate, run_gates

    model = args.reference if args.reference != "local" else (args.model or str(demo_model()))
    prompts = load_prompts(args.prompts or PROMPTS)
    if args.matrix:
        configs = [GateConfig(WireConfig(mode, codec, codec), args.min_argmax, args.min_cosine)
                   for mode in COMBINE_MODES for codec in FLOAT_CODECS]
        reports = run_gates(model, prompts, configs, args.workers)
        if args.json:
            print(json.dumps([report.to_json(args.reference) for report in reports]))
        else:
            for report in reports:
                print(_line(report))
        return 0
    config = GateConfig(wire, args.min_argmax, args.min_cosine)
    report = run_gate(model, prompts, config, args.workers)
    print(json.dumps(report.to_json(args.reference)) if args.json else _line(report))
    return 0 if report.passed else 1


def _line(report: GateReport) -> str:
    wire = report.config.wire
    return (f"gate {wire.mode.value:<7} dispatch={wire.dispatch_codec or 'lossless':<9} "
            f"combine={wire.combine_codec or 'lossless':<9} "
            f"argmax {report.argmax_agreement:.4f} cosine min {report.cosine_min:.5f} "
            f"mean {report.cosine_mean:.6f} ({report.positions} positions, "
            f"{report.bytes_out_per_token_layer:.0f}+{report.bytes_in_per_token_layer:.0f} B/token/layer): "
            + ("PASSED" if report.passed else "FAILED"))
