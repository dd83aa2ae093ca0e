"""`moeswarm dht`: a standing DHT node for a swarm to meet at (it holds announcements, serves no experts).

Workers and backbones join it with `--swarm MULTIADDR`. Any worker started with `--swarm new` is
such a node too; a separate one outlives the workers, as Petals' bootstrap peers do.
"""

from __future__ import annotations

import argparse
import signal
import threading

from moeswarm.commands._swarm import keyed_dht, swarm_peers
from moeswarm.commands._tls import add_swarm_key
from moeswarm.commands._types import port
from moeswarm.discovery.dht import SwarmDht


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=port, default=0, help="TCP port (0: pick a free one)")
    parser.add_argument("--swarm", type=swarm_peers, default=None, metavar="PEERS",
                        help="join the swarm at these DHT peers (comma-separated multiaddrs) instead of starting one")
    add_swarm_key(parser)  # keyed: this node stores and serves only records signed by the swarm's members


def run(args: argparse.Namespace) -> int:
    dht = SwarmDht.open(args.swarm or [], host=args.host, port=args.port, **keyed_dht(args.swarm_key))
    try:
        print(f"moeswarm dht: running; join with --swarm {','.join(dht.addresses())}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        dht.close()
    return 0
