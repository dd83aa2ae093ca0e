"""A placement planned from a routing profile, with what a simulation of decode over the profile's
routing expects of it against the naive contiguous split: `moeswarm plan`'s numbers.

The estimate draws its own pseudo-rows (SIMULATION_SEED, not the planner's draws): a plan must not
be scored on what it was fitted to.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from moeswarm.errors import MoeSwarmError
from moeswarm.placement.plan_file import Plan, WorkerSpec
from moeswarm.placement.planner import contiguous_plan, plan_placement, pseudo_rows, routing_from_profile
from moeswarm.placement.profile import read_profile
from moeswarm.placement.simulate import simulate

SIMULATION_ROWS = 2048  # pseudo-rows per layer for the estimate
SIMULATION_SEED = 1_000_003  # not the planner's draws: the estimate must not score the plan on what it was fitted to


def plan_from_profile(profile: str, workers: Sequence[WorkerSpec], replicas: int = 0,
                      output: str | None = None) -> tuple[Plan, dict]:
    """(the plan, its estimate) for the profile at `profile`; the plan (with its estimate) written to
    `output` when given, for `moeswarm worker --plan`."""
    routing = routing_from_profile(read_profile(profile))
    if not routing:
        raise MoeSwarmError(f"{profile}: the profile has no layers")
    plan = plan_placement(routing, workers, replicas)
    rows = {layer: pseudo_rows(stats, SIMULATION_ROWS, SIMULATION_SEED + layer) for layer, stats in routing.items()}
    planned = simulate(plan, rows)
    naive = simulate(contiguous_plan(plan.num_experts, plan.layers, workers), rows)
    estimate = {"rows_per_layer": SIMULATION_ROWS, "planned": _brief(planned), "contiguous": _brief(naive),
                "layer_call_change": planned["layer_call_ms"] / naive["layer_call_ms"] - 1}
    if output:
        try:
            with open(output, "w") as out:
                json.dump(plan.to_json(estimate), out, indent=1)
        except OSError as error:
            raise MoeSwarmError(f"cannot write {output}: {error.strerror or error}") from None
    return plan, estimate


def _brief(result: dict) -> dict:
    return {key: result[key] for key in ("workers_per_token_layer", "layer_call_ms")}
