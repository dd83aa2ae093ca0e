"""`moeswarm join INVITE` for a stages swarm: read the stages announced, take the weakest span, serve it.

join.py hands over here once the invite says `stages` (and the manifest is fetched). The span is
chosen by discovery/stage_joining.py; its slice is fetched from the invite's seeder; then this
process is a `moeswarm stage` of that span over the slice, every expert of its layers held in its
own process, announced on the swarm's DHT for gateways (`generate`/`serve --swarm INVITE`). Every
`--rebalance` seconds it looks whether a span is held by at least 2 fewer stages than its own
(one that lost every stage, or 1 beside 3), and moves there if it is the one to
(node/stage_member.py). The pieces it fetched (from other members' seeds and the invite's seeder)
are kept and served to later joiners (node/stage_seed.py) unless `--no-seed` (docs/network.md,
Stages swarms).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path


def run_stage_member(args: argparse.Namespace, invite, manifest, directory: Path, memory_bytes: int) -> int:
    """Choose the span, fetch its slice, serve it as an announced stage (moving it every
    `args.rebalance` seconds when the swarm needs it elsewhere) until SIGTERM or Ctrl-C."""
    from moeswarm.commands._setup import set_backbone_threads
    from moeswarm.commands._swarm import keyed_dht
    from moeswarm.commands._tls import client_tls, server_tls
    from moeswarm.discovery.announce import announce_address
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.discovery.joining import announce_joining, joining_address
    from moeswarm.discovery.joining_record import JOINING, JoiningRecord
    from moeswarm.discovery.seed_record import SEEDS
    from moeswarm.discovery.stage_joining import (
        drop_stage_slice, fetch_stage_slice, plan_span, span_bytes, stage_seed_layers, stage_slice_path, swarm_cut,
    )
    from moeswarm.discovery.stage_record import STAGES
    from moeswarm.node.member_seed import open_member_seed
    from moeswarm.node.stage_member import StageMember
    from moeswarm.node.stage_seed import SpanSeed
    from moeswarm.slices.sources import fetch_sources
    from moeswarm.stages.node import StageAnnouncement, StageOptions, open_stage_node
    from moeswarm.stages.server import StageLimits
    from moeswarm.swarm_config import SwarmConfig

    announce_address(args.host, 1, args.announce_host)  # 0.0.0.0 needs an announce host: say so before fetching
    # a node of its own until the stage is announced: it keeps this joiner's choice on the DHT meanwhile
    reader = SwarmDht.open(list(invite.dht), host=args.host, **keyed_dht(args.swarm_key))
    try:
        joining = [r for r in reader.fetch(invite.model, JOINING).values() if r.layers is not None]
        span, holders = plan_span(manifest, invite, [*reader.fetch(invite.model, STAGES).values(), *joining],
                                  memory_bytes)
        seeds = list(reader.fetch(invite.model, SEEDS).values())  # for the first fetch
        intent = announce_joining(reader, JoiningRecord(joining_address(reader.addresses()[0]), invite.model,
                                                        layers=span), args.announce_ttl, _say)
    except BaseException:
        reader.close()
        raise
    cut = swarm_cut(manifest, invite)
    _say("span: layers {}-{} of a cut into {} (stages holding or joining each: {}; {} joining)".format(
        span.start, span.stop - 1, ", ".join(f"{s.start}-{s.stop - 1}" for s in cut),
        ", ".join(map(str, holders)), len(joining)))
    tls = client_tls(args.swarm_key)
    announcement = StageAnnouncement(tuple(invite.dht), args.announce_host, args.announce_ttl, args.dht_port,
                                     args.swarm_key)
    sizes = {(s.start, s.stop): span_bytes(manifest, s) for s in cut}

    order = os.urandom(16)  # this joiner's order of the seeds: joiners arriving together spread over them

    def open_node(span: range, port: int = 0, dht=None):  # a moved span listens on a free port: the old one still serves
        found = seeds if dht is None else dht.fetch(invite.model, SEEDS).values()  # read again at a move
        sources = fetch_sources(invite.seed, found, manifest, tls is not None, seed and seed.address, order)
        reuse = () if dht is None else [stage_slice_path(directory, invite.model, member.span)]  # a move: the trunk
        path = fetch_stage_slice(invite, manifest, span, directory, tls, args.timeout, _say, sources,
                                 keep_pieces=not args.no_seed, reuse=reuse)
        options = StageOptions(str(path), span, args.host, port, (), StageLimits(),
                               server_tls(args.swarm_key, args.host), "file", announcement)
        return open_stage_node(options, lambda source: SwarmConfig(tls=tls), report=_say, dht=dht)

    def read() -> dict[str, range]:
        return {address: record.layers for address, record in member.node.dht.fetch(invite.model, STAGES).items()}

    def moved(old: range) -> None:  # the old node is closed: seed the new span, then free the old one's disk
        if seed is not None:
            seed.follow(member.span)
        freed = drop_stage_slice(directory, invite.model, old)
        _say(f"removed the slice of layers {old.start}-{old.stop - 1} ({freed} bytes on disk)")

    def open_seed(span: range, first: bool):
        return open_member_seed(stage_slice_path(directory, invite.model, span), manifest, manifest.data["expert_ids"],
                                server_tls(args.swarm_key, args.host), member.node.dht, args.host,
                                args.seed_port if first else 0, args.announce_host, args.announce_ttl,
                                stage_seed_layers(manifest, span), trunk=True)

    set_backbone_threads(args.threads)
    seed = None
    try:
        first = open_node(span, args.port)
    finally:
        if intent is not None:
            intent.stop()  # the stage's own record now says what it holds
        reader.close()
    member = StageMember(first, cut, lambda span: open_node(span, dht=member.node.dht), read, _say,
                         fits=lambda span: sizes[(span.start, span.stop)] <= memory_bytes, on_move=moved,
                         on_stop=lambda: seed is not None and seed.stop())
    if not args.no_seed:
        seed = SpanSeed(open_seed, _say)
        try:
            seed.follow(span)
        except BaseException:
            seed.stop()
            first.close()
            raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from moeswarm.gc_freeze import freeze_loaded

    freeze_loaded()
    member.serve(stop, args.rebalance)  # closes the node it ends with
    node = member.node
    _say(f"stopped after {member.steps + node.steps} steps, {member.moves} moves")
    return 0


def _say(line: str) -> None:
    print(f"moeswarm join: {line}", flush=True)
