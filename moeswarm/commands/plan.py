"""`moeswarm plan`: place a model's experts on workers of given capacity and RTT, from a routing profile.

Prints each worker's `--experts` per layer (or writes the plan for `moeswarm worker --plan`) and
what a simulation of decode over the profile's routing expects: workers reached per token-layer
and mean layer-call time, against the naive contiguous split over the same workers.
"""

from __future__ import annotations

import argparse
import json

from moeswarm.commands._types import non_negative

SIMULATION_ROWS = 2048  # pseudo-rows per layer for the estimate
SIMULATION_SEED = 1_000_003  # not the planner's draws: the estimate must not score the plan on what it was fitted to


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
    from moeswarm.placement.plan_file import parse_worker_spec

    try:
        return [parse_worker_spec(part.strip()) for part in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    from moeswarm.commands._setup import set_threads
    from moeswarm.errors import MoeSwarmError
    from moeswarm.placement.planner import contiguous_plan, plan_placement, pseudo_rows, routing_from_profile
    from moeswarm.placement.profile import read_profile
    from moeswarm.placement.simulate import simulate

    if args.machines:
        from moeswarm.commands import plan_islands

        return plan_islands.run(args)
    if not args.profile or not args.workers:
        raise MoeSwarmError("give --profile and --workers (experts on workers), or --machines (islands)")
    set_threads(None)
    routing = routing_from_profile(read_profile(args.profile))
    if not routing:
        raise MoeSwarmError(f"{args.profile}: the profile has no layers")
    plan = plan_placement(routing, args.workers, args.replicas)
    rows = {layer: pseudo_rows(stats, SIMULATION_ROWS, SIMULATION_SEED + layer) for layer, stats in routing.items()}
    planned = simulate(plan, rows)
    naive = simulate(contiguous_plan(plan.num_experts, plan.layers, args.workers), rows)
    estimate = {"rows_per_layer": SIMULATION_ROWS, "planned": _brief(planned), "contiguous": _brief(naive),
                "layer_call_change": planned["layer_call_ms"] / naive["layer_call_ms"] - 1}
    data = plan.to_json(estimate)
    if args.output:
        try:
            with open(args.output, "w") as out:
                json.dump(data, out, indent=1)
        except OSError as error:
            raise MoeSwarmError(f"cannot write {args.output}: {error.strerror or error}") from None
    if args.json:
        print(json.dumps(data))
    else:
        print("\n".join(describe(plan, estimate, args.model, args.output)))
    return 0


def _brief(result: dict) -> dict:
    return {key: result[key] for key in ("workers_per_token_layer", "layer_call_ms")}


def describe(plan, estimate: dict, model: str, output: str | None) -> list[str]:
    """The text `moeswarm plan` prints: per worker its command, then the estimate."""
    from moeswarm.placement.plan_file import format_layer_experts

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
