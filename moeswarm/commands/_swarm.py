"""`--swarm PEERS`: finding workers on the DHT (discovery/dht.py) instead of a `--workers` list.

A worker announces itself (`moeswarm worker --swarm new` starts a swarm and prints the multiaddr
others join by); a backbone (`generate`, `serve`) joins as a client, waits until the announced
workers cover the model, and follows joins and leaves. Parsing here imports neither torch nor
hivemind: `--workers` works without hivemind installed.
"""

from __future__ import annotations

import argparse
import sys

from moeswarm.commands._types import port, seconds
from moeswarm.discovery.dht import parse_peers
from moeswarm.discovery.follow import DiscoveryOptions
from moeswarm.errors import MoeSwarmError
from moeswarm.transport.member_cert import Authority, Identity

DEFAULT_TTL_S = 30.0  # discovery/announce.py's default, restated so `--help` imports no torch


class InvitePeers(list):
    """An invite's DHT peers (a list of multiaddrs), with its swarm's mode: `stages`, the spans of a
    stages swarm's cut, or None for an experts swarm (discovery/invite.py)."""

    stages: int | None = None
    invite: object = None  # the Invite itself (its swarm's certificate hash, for the --swarm-key check)


def swarm_peers(text: str) -> list[str]:
    """argparse type of `--swarm`: [] for "new", else the peers' multiaddrs, or an invite's
    (`moeswarm invite`: its DHT peers, as InvitePeers)."""
    from moeswarm.discovery.invite import InviteError, looks_like_invite, parse_invite

    try:
        if not looks_like_invite(text):
            return parse_peers(text)
        invite = parse_invite(text)
    except (ValueError, InviteError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    peers = InvitePeers(invite.dht)
    peers.stages = invite.stages
    peers.invite = invite
    return peers


def add_worker_swarm(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("swarm", "announce this worker on the swarm's DHT (docs/discovery.md)")
    group.add_argument("--swarm", type=swarm_peers, default=None, metavar="PEERS",
                       help="join the swarm at these DHT peers (comma-separated multiaddrs /ip4/HOST/tcp/PORT/p2p/ID) "
                            "and announce this worker there; 'new': start a new swarm (its multiaddr is printed)")
    group.add_argument("--announce-host", default=None, metavar="HOST",
                       help="the address backbones dial this worker at (default: --host, which must then not be "
                            "0.0.0.0)")
    group.add_argument("--announce-ttl", type=seconds, default=DEFAULT_TTL_S, metavar="SECONDS",
                       help=f"the announcement expires this long after each refresh (every third of it); a worker "
                            f"that vanishes is dropped by backbones within about this long (default {DEFAULT_TTL_S:g})")
    group.add_argument("--dht-port", type=port, default=0, metavar="PORT",
                       help="TCP port of this worker's DHT node, on --host (0: a free one)")


def add_backbone_swarm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm", type=swarm_peers, default=None, metavar="PEERS",
                        help="find the workers on the swarm instead of --workers: an invite (`moeswarm invite`) or "
                             "comma-separated multiaddrs of DHT peers (a worker's or `moeswarm dht`'s); joins and leaves are followed while running")
    parser.add_argument("--swarm-wait", type=seconds, default=60.0, metavar="SECONDS",
                        help="with --swarm: the most to wait at start for workers covering every MoE layer")


def check_workers_or_swarm(args: argparse.Namespace) -> None:
    """At most one of --workers and --swarm; neither: the local mode, every expert in this process
    (MoeSwarmError otherwise: one line, exit status 2). A stages swarm's invite in --swarm is moved
    where it belongs: `--stages-swarm` of generate and serve (the gateway routes through the swarm's
    stages), `--announce-swarm` of stage (the stage is announced there, its experts its own). An
    invite's swarm key is checked against --swarm-key at once (discovery/joining.py `check_key`):
    a keyed swarm's records are unreadable without a member file, so waiting for them would only
    end in a misleading gap."""
    invite = getattr(args.swarm, "invite", None)
    if invite is not None:
        from moeswarm.discovery.joining import check_key

        check_key(invite, getattr(args, "swarm_key", None))
    _stages_invite(args)
    if args.workers and args.swarm is not None:
        raise MoeSwarmError("give --workers or --swarm, not both: a fixed list of workers, or the swarm to find them on")
    if args.swarm == []:
        raise MoeSwarmError("--swarm new starts a swarm, which only a worker does: give the multiaddr a worker "
                            "or `moeswarm dht` printed")


def model_from_swarm(args: argparse.Namespace) -> None:
    """Without --model, `--swarm INVITE` (or `--stages-swarm INVITE`) gives it: the backbone slice
    of the invite's model fetched from its seeder, the whole model with --check-local
    (discovery/invite_model.py); set as `args.model`. MoeSwarmError without either."""
    if args.model is not None:
        return
    invite = getattr(args.swarm, "invite", None) or getattr(getattr(args, "stages_swarm", None), "invite", None)
    if invite is None:
        raise MoeSwarmError("give --model (a model directory or .gguf file), or --swarm INVITE to fetch the "
                            "backbone from the swarm's seeder")
    from moeswarm.commands._tls import client_tls
    from moeswarm.discovery.invite_model import cache_dir, model_from_invite
    from moeswarm.slices.fetch import TIMEOUT_S

    args.model = str(model_from_invite(invite, cache_dir(), client_tls(getattr(args, "swarm_key", None)), TIMEOUT_S,
                                       bool(getattr(args, "check_local", False)), _stderr(args)))


def _stages_invite(args: argparse.Namespace) -> None:
    if not getattr(args.swarm, "stages", None):
        return
    target = "stages_swarm" if hasattr(args, "stages_swarm") else "announce_swarm"
    flag = "--" + target.replace("_", "-")
    if getattr(args, target, None) is not None or getattr(args, "stages", None) or args.workers:
        raise MoeSwarmError(f"--swarm INVITE of a stages swarm stands for {flag} INVITE: give one of them, "
                            "without --workers or --stages")
    setattr(args, target, args.swarm)
    args.swarm = None


def discovery_options(args: argparse.Namespace, report=None):
    """The backbone's DiscoveryOptions for `--swarm`, or None with `--workers`."""
    if args.swarm is None:
        return None
    return DiscoveryOptions(tuple(args.swarm), args.swarm_wait, report=report or _stderr(args),
                            swarm_key=getattr(args, "swarm_key", None))


def _stderr(args: argparse.Namespace):
    def report(line: str) -> None:
        if not getattr(args, "quiet", False):
            print(f"moeswarm: {line}", file=sys.stderr, flush=True)

    return report


def keyed_dht(key_file: str | None) -> dict:
    """SwarmDht.open's authority and identity for `--swarm-key` (transport/member_cert.py): {} without one."""
    if not key_file:
        return {}
    return {"authority": Authority.load(key_file), "identity": Identity.load(key_file)}
