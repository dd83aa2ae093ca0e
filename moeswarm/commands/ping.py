"""`moeswarm ping`: what each running worker serves, and its PING round trip (transport/ping.py).

A worker tells what it holds only in its answer to a HELLO that carries the right model
fingerprint (docs/protocol.md); any other HELLO gets an ERROR. So ping takes the model
(`--model`, the same path the backbone would use) and computes the fingerprint from it: the
backbone's own handshake, with no protocol change and no parsing of error text. A worker that
serves another model is reported as such (the ERROR names its model), like an unreachable one.
"""

from __future__ import annotations

import argparse
import json
import sys

from moeswarm.commands._swarm_flags import workers_list as worker_addresses
from moeswarm.commands._tls import add_swarm_key, client_tls
from moeswarm.commands._types import positive
from moeswarm.ids import format_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workers", type=worker_addresses, help="comma-separated HOST:PORT list")
    parser.add_argument("--model", required=True,
                        help="the model the workers serve (directory or .gguf; a slice file of it works too): "
                             "its fingerprint opens the HELLO that a worker answers with what it holds")
    parser.add_argument("--count", type=positive, default=10, metavar="N", help="PINGs timed per worker")
    add_swarm_key(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from moeswarm.transport.ping import ping_workers

    fingerprint, reports = ping_workers(args.model, args.workers, args.count, client_tls(args.swarm_key))
    if args.json:
        print(json.dumps({"model": args.model, "fingerprint": fingerprint, "workers": reports}))
    else:
        for report in reports:
            if report["ok"]:
                print(_line(report), flush=True)
            else:
                print(f"moeswarm ping: error: {report['error']}", file=sys.stderr, flush=True)
    return 0 if all(report["ok"] for report in reports) else 1


def held_text(held: dict[str, list[int]]) -> str:
    """"layers 0-5 experts 0-15" when every layer holds the same experts, else one "layer L: ..." per layer."""
    layers = sorted(int(layer) for layer in held)
    sets = {tuple(experts) for experts in held.values()}
    if len(sets) == 1:
        return f"layers {format_ids(layers)} experts {format_ids(sets.pop())}"
    return "; ".join(f"layer {layer}: experts {format_ids(held[str(layer)])}" for layer in layers)


def _line(report: dict) -> str:
    return (f"{report['address']}  {report['model_type']} {report['fingerprint']}  {held_text(report['held'])} "
            f"(of {report['num_experts']})  PING min {report['rtt_us_min']:.0f} us, "
            f"p50 {report['rtt_us_p50']:.0f} us over {report['pings']}")
