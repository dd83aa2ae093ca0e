"""`moeswarm plan`: place a model's experts on workers of given capacity and RTT, from a routing profile.

Prints each worker's `--experts` per layer (or writes the plan for `moeswarm worker --plan`) and
what a simulation of decode over the profile's routing expects: workers reached per token-layer
and mean layer-call time, against the naive contiguous split over the same workers.
"""

from __future__ import annotations

import argparse
import json

from moeswarm.commands import plan_islands
from moeswarm.commands._setup import set_threads
from moeswarm.commands._types import non_negative
from moeswarm.errors import MoeSwarmError
from moeswarm.placement.plan_file import format_layer_experts, parse_worker_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", metavar="PROFILE.json",
                        help="routing profile: `moeswarm profile --model M -o PROFILE.json`")
    parser.add_argument("--workers", type=_workers, metavar="NAME:CAPACITY:RTT_MS,...",
                        help="the workers: a name, room in experts per layer, round trip in ms, e.g. a:10:20,b:10:80")
    parser.add_argument("--replicas", type=non_negative, default=0, metavar="N",
                        help="replica budget: extra expert copies per layer beyond one of each, for the hottest")
    parser.add_argument("--model", default="MODEL", help="model path to write into the printed worker commands")
    parser.add_argument("-o", "--output", default=None, metavar="PLAN.json",
                        help="write the plan: workers start from it with --plan PLAN.json --plan-worker NAME")
    parser.add_argument("--json", action="store_true", help="print the plan and its estimate as JSON")
    islands = parser.add_argument_group("islands", "instead of --profile and --workers: place stages (docs/stages.md)")
    islands.add_argument("--machines", metavar="MACHINES.json",
                         help='machines and the RTT between every two: {"gateway": "a", "machines": [{"name": "a", '
                              '"room": 0.5, "ms_per_layer": 4}, ...], "rtt_ms": {"a b": 0.3, ...}}; prints islands '
                              "and the expected ms per token of star, islands and a layer split")
    islands.add_argument("--layers", type=int, default=None, help="with --machines: the model's decoder layers")
    islands.add_argument("--island-rtt", type=float, default=5.0, metavar="MS",
                         help="with --machines: machines within this RTT of each other form an island (default 5)")


def _workers(text: str):
    try:
        return [parse_worker_spec(part.strip()) for part in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    if args.machines:
        return plan_islands.run(args)
    if not args.profile or not args.workers:
        raise MoeSwarmError("give --profile and --workers (experts on workers), or --machines (islands)")
    set_threads(None)
    from moeswarm.placement.plan_estimate import plan_from_profile

    plan, estimate = plan_from_profile(args.profile, args.workers, args.replicas, args.output)
    if args.json:
        print(json.dumps(plan.to_json(estimate)))
    else:
        print("\n".join(describe(plan, estimate, args.model, args.output)))
    return 0


def describe(plan, estimate: dict, model: str, output: str | None) -> list[str]:
    """The text `moeswarm plan` prints: per worker its command, then the estimate."""
    slots = sum(w.spec.capacity for w in plan.workers)
    lines = [f"plan: {len(plan.workers)} workers, {plan.num_experts} experts x {len(plan.layers)} MoE layers, "
             f"replica budget {plan.replicas} per layer (room {slots} per layer)"]
    for worker in plan.workers:
        spec = worker.spec
        held = sum(len(ids) for ids in worker.experts.values())
        lines.append(f"\n{spec.name}: RTT {spec.rtt_ms:g} ms, capacity {spec.capacity}, holds {held} experts over "
                     f"{len(worker.experts)} layers")
        if output:
            lines.append(f"  moeswarm worker --model {model} --plan {output} --plan-worker {spec.name}")
        lines.append(f"  moeswarm worker --model {model} --experts '{format_layer_experts(worker.experts)}'")
    planned, naive = estimate["planned"], estimate["contiguous"]
    lines += ["", f"estimate: decode, one star call per token-layer, {estimate['rows_per_layer']} rows per layer drawn "
                  f"from the profile; RTTs only (no compute, no fixed cost per call)",
              f"  {'placement':<12} {'workers reached / token-layer':>30} {'mean layer call ms':>20}",
              f"  {'contiguous':<12} {naive['workers_per_token_layer']:>30.2f} {naive['layer_call_ms']:>20.1f}",
              f"  {'planned':<12} {planned['workers_per_token_layer']:>30.2f} {planned['layer_call_ms']:>20.1f}"
              f"  ({100 * estimate['layer_call_change']:+.1f} %)"]
    return lines
