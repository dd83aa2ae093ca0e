"""`moeswarm invite`: start a swarm's first member (or attach one to a swarm) and print its invite.

The first line of standard output is the invite alone (discovery/invite.py): give it to
`moeswarm join`, `generate --swarm`, `serve --swarm`, `status`. What follows goes to standard
error. It runs until SIGTERM or Ctrl-C (docs/network.md, Invites).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from moeswarm.commands._swarm import swarm_peers
from moeswarm.commands._tls import add_swarm_key
from moeswarm.commands._types import port, positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the GGUF model file the swarm serves (its pieces are seeded)")
    parser.add_argument("--manifest", default=None, metavar="FILE",
                        help="the model's manifest (default: MODEL.manifest.json beside it, made when absent or stale)")
    parser.add_argument("--swarm", type=swarm_peers, default=None, metavar="PEERS",
                        help="attach to the swarm at these DHT peers (multiaddrs or an invite) instead of starting one")
    parser.add_argument("--host", default="127.0.0.1", help="address the DHT node and seeders listen on")
    parser.add_argument("--announce-host", default=None, metavar="HOST",
                        help="the address joiners dial the seeders at (default: --host, which must then not be 0.0.0.0)")
    parser.add_argument("--dht-port", type=port, default=0, help="TCP port of the DHT node (0: a free one)")
    parser.add_argument("--seed-port", type=port, default=0, help="TCP port of the model's seeder (0: a free one)")
    parser.add_argument("--manifest-port", type=port, default=0, help="TCP port of the manifest's seeder (0: a free one)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stages", type=positive, nargs="?", const=0, default=None, metavar="N",
                      help="a stages swarm: the model cut into N spans of decoder layers, each joiner serving one "
                           "(the span with the fewest stages) with its experts; N omitted: spans of about 8 layers, "
                           "at least 2 (docs/network.md, Stages swarms)")
    mode.add_argument("--experts-only", dest="stages", action="store_const", const=None,
                      help="an experts swarm (the default): each joiner serves experts of every MoE layer")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr")
    add_swarm_key(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from moeswarm.discovery.inviter import InviterConfig, open_inviter

    config = InviterConfig(args.model, args.manifest, tuple(args.swarm or ()), args.host, args.announce_host,
                           args.dht_port, args.seed_port, args.manifest_port, args.swarm_key, args.stages)
    inviter = open_inviter(config)
    asyncio.run(_serve(inviter))
    return 0


async def _serve(inviter) -> None:
    from moeswarm.discovery.inviter import serve_until
    from moeswarm.stop_signal import stop_event

    def say(text: str) -> None:
        print(text, flush=True)  # the first line of stdout: the invite alone
        invite = inviter.invite
        print(f"moeswarm invite: model {invite.model} seeded at {invite.seed} (manifest {invite.manifest} at "
              f"{invite.manifest_seed}); DHT at {', '.join(invite.dht)}; "
              f"{'keyed: joiners need a member file of this swarm' if invite.swarm else 'unkeyed'}; "
              f"{f'a stages swarm of {invite.stages} spans' if invite.stages else 'an experts swarm'}; "
              f"join with: moeswarm join INVITE", file=sys.stderr, flush=True)

    await serve_until(inviter, stop_event((signal.SIGTERM, signal.SIGINT)), [say])
