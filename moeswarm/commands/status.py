"""`moeswarm status INVITE`: the swarm as announced on its DHT: members, shares, seeds, coverage per layer.

It joins the DHT as a client (it stores nothing), fetches the manifest the invite pins (for the
model's layers and experts), reads the announcements once, prints a table (or `--json`) and exits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeswarm.commands._tls import add_swarm_key, client_tls
from moeswarm.commands._types import seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("invite", help="the invite `moeswarm invite` printed")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="where the manifest is kept (default: `moeswarm join`'s cache directory)")
    parser.add_argument("--timeout", type=seconds, default=30.0, help="seconds to connect to the manifest's seeder")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_swarm_key(parser)


def run(args: argparse.Namespace) -> int:
    from moeswarm.commands.join import _cache_dir, _make_dir
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.discovery.invite import parse_invite
    from moeswarm.discovery.joining import check_key, layout
    from moeswarm.discovery.seed_record import SEEDS
    from moeswarm.discovery.stage_record import STAGES
    from moeswarm.discovery.swarm_view import format_view, swarm_view
    from moeswarm.slices.manifest_fetch import fetch_manifest

    invite = parse_invite(args.invite)
    check_key(invite, args.swarm_key)
    directory = Path(args.dir) if args.dir else _cache_dir()
    _make_dir(directory)
    manifest = fetch_manifest(invite.manifest_seed, invite.manifest, invite.manifest_bytes,
                              directory / f"{invite.manifest}.manifest.json", client_tls(args.swarm_key), args.timeout)
    layers, num_experts = layout(manifest, invite)
    authority = None
    if args.swarm_key:
        from moeswarm.transport.member_cert import Authority

        authority = Authority.load(args.swarm_key)
    dht = SwarmDht.open(list(invite.dht), client=True, authority=authority)
    try:
        records = dht.fetch(invite.model)
        stages = [(address, record.layers) for address, record in sorted(dht.fetch(invite.model, STAGES).items())]
        seeds = [(address, record.experts) for address, record in sorted(dht.fetch(invite.model, SEEDS).items())
                 if record.manifest == invite.manifest]
    finally:
        dht.close()
    members, rows = swarm_view(records, layers, num_experts)
    if args.json:
        print(json.dumps({"model": invite.model, "members": [m.__dict__ for m in members],
                          "stages": [{"address": a, "layers": [s.start, s.stop - 1]} for a, s in stages],
                          "seeds": [{"address": a, "experts": list(e)} for a, e in seeds],
                          "layers": [{**r.__dict__, "weakest": list(r.weakest)} for r in rows]}))
    else:
        print(format_view(invite.model, members, rows, stages, seeds))
    return 0
