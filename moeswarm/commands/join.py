"""`moeswarm join INVITE`: take a share of a swarm where it is weakest, fetch just those bytes, serve them.

In a stages swarm (`moeswarm invite --stages`) the share is a span of layers, served as a stage
(commands/_join_stage.py); what follows is an experts swarm's.

No expert list, no manifest file, no multiaddr: the invite (`moeswarm invite`) names them. The
share is sized to `--memory` and chosen from the coverage announced on the DHT
(discovery/joining.py); then the process is a `moeswarm worker` of that share, announced on the
swarm, and every `--rebalance` seconds it looks whether to move part of its share where the swarm
needs it (node/rebalancing.py; docs/network.md, Invites and join, Rebalancing). The pieces it
fetched (from the invite's seeder or from other members' seeds: slices/sources.py) are kept and
served to later joiners (node/member_seed.py) unless `--no-seed`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
from dataclasses import replace

from moeswarm.commands._setup import add_quiet, quiet_progress
from moeswarm.commands._tls import add_swarm_key, client_tls, server_tls
from moeswarm.commands._types import non_negative_seconds, port, positive, seconds
from moeswarm.node.rebalancing import DEFAULT_INTERVAL_S
from moeswarm.commands.worker import _add_relay, _load, _say
from moeswarm.worker.config import DEFAULT_ANNOUNCE_TTL_S, INLINE_TOKENS, Hosting, WorkerConfig
from moeswarm.worker.limits import WorkerLimits

MEMORY_SHARE = 0.5  # of the memory available now, without --memory


def gigabytes(text: str) -> float:
    """argparse type of `--memory`: a positive number of GB (10^9 bytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GB, got {text!r}") from None
    if not 0 < value < 1 << 20:
        raise argparse.ArgumentTypeError(f"must be a positive number of GB, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("invite", help="the invite `moeswarm invite` printed (one line: moeswarm-invite-1....)")
    parser.add_argument("--memory", type=gigabytes, default=None, metavar="GB",
                        help=f"memory for this member's experts, in GB: its share is as many experts as fit (in a "
                             f"stages swarm: the weakest span that fits) (default: {MEMORY_SHARE:g} of the memory "
                             f"available now)")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="where the manifest and the share's slice are kept, by this member alone while it runs "
                             "(a run again resumes or reuses them; default: the first of member-0, member-1, ... in "
                             "$XDG_CACHE_HOME/moeswarm/join or ~/.cache/moeswarm/join that no running member holds)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=port, default=0, help="TCP port of the worker (0: a free one)")
    parser.add_argument("--announce-host", default=None, metavar="HOST",
                        help="the address backbones dial this member at (default: --host, which must then not be "
                             "0.0.0.0)")
    parser.add_argument("--announce-ttl", type=seconds, default=DEFAULT_ANNOUNCE_TTL_S, metavar="SECONDS",
                        help="the announcement expires this long after each refresh")
    parser.add_argument("--rebalance", type=non_negative_seconds, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                        help="read the swarm's coverage this often and move part of the share where the swarm needs "
                             "it (fetch first, then drop; one member a round; docs/network.md, Rebalancing; in a "
                             "stages swarm: move to a span held by at least 2 fewer stages); 0: never")
    parser.add_argument("--dht-port", type=port, default=0, metavar="PORT", help="TCP port of this member's DHT node")
    parser.add_argument("--seed-port", type=port, default=0, metavar="PORT",
                        help="TCP port of this member's seed of the pieces it fetched (0: a free one)")
    parser.add_argument("--no-seed", action="store_true",
                        help="do not keep the fetched pieces nor serve them to later joiners (by default a member "
                             "keeps them beside its slice, serves them and announces itself as a seed)")
    parser.add_argument("--threads", type=positive, default=None, help="torch CPU threads of the worker")
    parser.add_argument("--timeout", type=seconds, default=30.0,
                        help="seconds to connect to a seeder, and for each piece beyond its length at 64 KiB/s")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr")
    add_swarm_key(parser)
    _add_relay(parser)
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.discovery.invite import parse_invite
    from moeswarm.discovery.invite_model import cache_dir
    from moeswarm.node.member_dir import claim_member_dir
    from moeswarm.errors import MoeSwarmError
    from moeswarm.discovery.joining import (
        announce_joining, check_key, drop_share, fetch_share, joining_address, joining_holders, layout, plan_share,
        share_path,
    )
    from moeswarm.discovery.joining_record import JOINING, JoiningRecord
    from moeswarm.discovery.seed_record import SEEDS
    from moeswarm.node.member_seed import ShareSeed, open_member_seed
    from moeswarm.slices.sources import fetch_sources
    from moeswarm.node.rebalancing import Member
    from moeswarm.ids import format_ids
    from moeswarm.slices.manifest_fetch import fetch_manifest
    from moeswarm.worker.listen import check_can_listen, raise_open_files_limit
    from moeswarm.node.worker import build_node

    invite = parse_invite(args.invite)
    check_key(invite, args.swarm_key)
    if invite.stages is not None and args.relay:
        raise MoeSwarmError("a stage is dialled directly: --relay is for an experts swarm's members")
    directory = claim_member_dir(args.dir, cache_dir())
    _say(f"keeping the share in {directory}")
    tls = client_tls(args.swarm_key)
    manifest = fetch_manifest(invite.manifest_seed, invite.manifest, invite.manifest_bytes,
                              directory / f"{invite.manifest}.manifest.json", tls, args.timeout)
    layers, num_experts = layout(manifest, invite)
    if invite.stages is not None:  # a stages swarm: this member serves a span of layers (docs/network.md)
        from moeswarm.commands._join_stage import run_stage_member

        return run_stage_member(args, invite, manifest, directory, _memory_bytes(args.memory))
    config = _worker_config(args, invite)
    keys = {}
    if args.swarm_key:
        from moeswarm.transport.member_cert import Authority, Identity

        keys = {"authority": Authority.load(args.swarm_key), "identity": Identity.load(args.swarm_key)}
    from moeswarm.discovery.announce import announce_address

    announce_address(args.host, 1, args.announce_host)  # 0.0.0.0 needs an announce host: say so before fetching
    dht = SwarmDht.open(list(invite.dht), host=args.host, port=args.dht_port, **keys)
    try:
        members = [(record.held, record.load) for record in dht.fetch(invite.model).values()]
        joining = joining_holders(dht.fetch(invite.model, JOINING).values(), layers)
        share = plan_share(manifest, layers, num_experts, members + joining, _memory_bytes(args.memory),
                           dht.addresses()[0].encode())
        measured = sum(load is not None for _, load in members)
        intent = announce_joining(dht, JoiningRecord(joining_address(dht.addresses()[0]), invite.model, share.experts),
                                  args.announce_ttl, _say)
        _say(f"share: experts {format_ids(share.experts)} of MoE layers {format_ids(layers)} "
             f"({share.covers} layer-expert pairs nobody held, {share.backs} held once; {len(members)} members announced, "
             f"{measured} with a measured load, {len(joining)} joining)")

        def sources():  # read again at each fetch: seeds join over time
            seeds = dht.fetch(invite.model, SEEDS).values()
            return fetch_sources(invite.seed, seeds, manifest, tls is not None, None, dht.addresses()[0].encode())

        held = [share.experts]  # the share whose slice the directory keeps

        def open_node(experts, port=0):  # a moved share listens on a free port: the old one still serves
            out = fetch_share(invite, manifest, experts, directory, tls, args.timeout, _say, sources(),
                              keep_pieces=not args.no_seed, reuse=[share_path(directory, invite.model, held[0])])
            return build_node(replace(config, port=port), functools.partial(_load, Hosting(str(out)), args.threads),
                              _say, dht)

        check_can_listen(config.host, config.port)
        raise_open_files_limit(config.limits.max_connections)
        node = open_node(share.experts, config.port)
        if intent is not None:
            intent.stop()  # the worker's own record now says what it holds
        seed_tls = server_tls(args.swarm_key, args.host) if not args.no_seed else None

        def open_seed(experts, first):
            return open_member_seed(share_path(directory, invite.model, experts), manifest, experts, seed_tls, dht,
                                    args.host, args.seed_port if first else 0, args.announce_host, args.announce_ttl)

        seed = None if args.no_seed else ShareSeed(open_seed, _say)

        async def moved(experts):  # the old node is closed: seed the new share, then free the old one's disk
            if seed is not None:
                await seed.follow(experts)
            freed = drop_share(directory, invite.model, held[0])
            held[0] = tuple(experts)
            _say(f"removed the slice of the share moved away from ({freed} bytes on disk)")

        member = Member(node, share.experts, layers, num_experts, open_node,
                        lambda: {a: (r.held, r.load) for a, r in dht.fetch(invite.model).items()}, _say,
                        on_move=moved)
        asyncio.run(_serve(member, args.rebalance, seed))
    finally:
        dht.close()
    server = member.node.server
    _say(f"stopped after {member.moves} moves of its share; {server.merged_requests} DISPATCHes of several "
         f"backbones ran in {server.merged_calls} merged expert calls")
    return 0


async def _serve(member, interval_s: float, seed) -> None:
    import signal

    from moeswarm.stop_signal import stop_event

    stop = stop_event((signal.SIGTERM, signal.SIGINT))
    if seed is not None:
        await seed.follow(member.share)
    try:
        await member.serve(stop, interval_s)
    finally:
        if seed is not None:
            await seed.stop()


def _worker_config(args: argparse.Namespace, invite) -> WorkerConfig:
    return WorkerConfig(host=args.host, port=args.port, limits=WorkerLimits(), inline_tokens=INLINE_TOKENS,
                        tls=server_tls(args.swarm_key, args.host), swarm_key=args.swarm_key, relay=args.relay,
                        relay_name=args.relay_name, relay_pool=args.relay_pool, swarm=tuple(invite.dht),
                        announce_host=args.announce_host, announce_ttl_s=args.announce_ttl, dht_port=args.dht_port)


def _memory_bytes(memory_gb: float | None) -> int:
    if memory_gb is not None:
        return int(memory_gb * 1e9)
    import psutil

    return int(psutil.virtual_memory().available * MEMORY_SHARE)

