"""`moeswarm plan --machines FILE`: islands from measured RTTs, and the expected per-token time of
star, islands and a pure layer split (placement/islands.py)."""

from __future__ import annotations

import argparse
import json

from moeswarm.errors import MoeSwarmError
from moeswarm.placement.islands import Machine, plan_islands


def read_machines(path: str):
    """(machines, rtts, gateway) from a JSON file:
    {"gateway": "a", "machines": [{"name": "a", "room": 0.5, "ms_per_layer": 4.0}, ...],
     "rtt_ms": {"a b": 0.3, "a c": 48.0, ...}} (every pair, names joined by a space)."""
    try:
        with open(path) as f:
            data = json.load(f)
        machines = [Machine(str(m["name"]), float(m["room"]), float(m["ms_per_layer"])) for m in data["machines"]]
        rtts = {frozenset(pair.split()): float(ms) for pair, ms in data["rtt_ms"].items()}
        gateway = str(data["gateway"])
    except OSError as error:
        raise MoeSwarmError(f"cannot read {path}: {error.strerror or error}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise MoeSwarmError(f"{path}: not a machines file ({type(error).__name__}: {error}); see `moeswarm plan "
                            "--help`") from None
    names = [m.name for m in machines]
    missing = [f"{a} {b}" for i, a in enumerate(names) for b in names[i + 1:] if frozenset((a, b)) not in rtts]
    if missing or gateway not in names:
        raise MoeSwarmError(f"{path}: " + (f"no RTT for {', '.join(missing[:5])}" if missing
                                           else f"the gateway {gateway!r} is not one of the machines"))
    return machines, rtts, gateway


def run(args: argparse.Namespace) -> int:
    if args.layers is None:
        raise MoeSwarmError("--machines needs --layers: the model's decoder layers")
    machines, rtts, gateway = read_machines(args.machines)
    try:
        estimate = plan_islands(machines, rtts, gateway, args.layers, args.island_rtt)
    except ValueError as error:
        raise MoeSwarmError(f"{args.machines}: {error}") from None
    if args.json:
        print(json.dumps({"islands": [{"members": list(i.members), "stage": i.stage,
                                       "layers": [i.layers.start, i.layers.stop - 1]} for i in estimate.islands],
                          "ms_per_token": {"islands": estimate.islands_ms, "star": estimate.star_ms,
                                           "layer_split": estimate.layer_split_ms}}))
        return 0
    print(f"islands (machines within {args.island_rtt:g} ms of each other), from the gateway {gateway}:")
    for island in estimate.islands:
        workers = [m for m in island.members if m != island.stage]
        span = f"{island.layers.start}-{island.layers.stop - 1}"
        held = f"its experts on {', '.join(workers)}" if workers else "its experts held by the stage itself"
        print(f"  layers {span}: stage on {island.stage}, {held}")
        holders = f" --workers {','.join(f'{w}:PORT' for w in workers)}" if workers else ""
        print(f"    moeswarm stage --model {args.model} --layers {span}{holders}")
    print("expected ms per decode token (RTTs and per-layer compute only):")
    print(f"  star (every layer a round trip to the farthest machine) {estimate.star_ms:10.1f}")
    print(f"  islands (one link per hop, LAN trips inside)              {estimate.islands_ms:10.1f}")
    print(f"  layer split ({' -> '.join(estimate.layer_split_order)})".ljust(58) + f"{estimate.layer_split_ms:10.1f}")
    return 0
