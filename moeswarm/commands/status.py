"""`moeswarm status INVITE`: the swarm as announced on its DHT: members, shares, seeds, coverage per layer.

It joins the DHT as a client (it stores nothing), fetches the manifest the invite pins (for the
model's layers and experts), reads the announcements once, prints a table (or `--json`) and exits.
Of a stages swarm it dials every announced stage as a gateway would (stages/survey.py): each
stage's round trip from here, the coverage per span of the swarm's cut with the weakest marked,
and the route a gateway here would take.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from moeswarm.commands._tls import add_swarm_key, client_tls
from moeswarm.commands._types import seconds

PINGS = 3  # a member's round trip from here is the least of these


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("invite", help="the invite `moeswarm invite` printed")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="where the manifest is kept (default: `moeswarm join`'s cache directory)")
    parser.add_argument("--timeout", type=seconds, default=30.0, help="seconds to connect to the manifest's seeder")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_swarm_key(parser)


def run(args: argparse.Namespace) -> int:
    from moeswarm.discovery.invite_model import cache_dir, make_dir
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.discovery.invite import parse_invite
    from moeswarm.discovery.joining import check_key, layout
    from moeswarm.discovery.joining_record import JOINING, joining_text
    from moeswarm.discovery.seed_record import SEEDS
    from moeswarm.discovery.stage_joining import swarm_cut
    from moeswarm.discovery.stage_record import STAGES
    from moeswarm.discovery.stage_view import format_stages, stage_json
    from moeswarm.discovery.swarm_view import format_view, swarm_view
    from moeswarm.slices.manifest_fetch import fetch_manifest
    from moeswarm.stages.survey import survey_stages

    invite = parse_invite(args.invite)
    check_key(invite, args.swarm_key)
    directory = make_dir(Path(args.dir) if args.dir else cache_dir())
    tls = client_tls(args.swarm_key)
    manifest = fetch_manifest(invite.manifest_seed, invite.manifest, invite.manifest_bytes,
                              directory / f"{invite.manifest}.manifest.json", tls, args.timeout)
    layers, num_experts = layout(manifest, invite)
    authority = None
    if args.swarm_key:
        from moeswarm.transport.member_cert import Authority

        authority = Authority.load(args.swarm_key)
    dht = SwarmDht.open(list(invite.dht), client=True, authority=authority)
    try:
        records = dht.fetch(invite.model)
        stage_records = dht.fetch(invite.model, STAGES)
        seeds = [(address, record.experts) for address, record in sorted(dht.fetch(invite.model, SEEDS).items())
                 if record.manifest == invite.manifest]
        joining = [(address, joining_text(record)) for address, record in sorted(dht.fetch(invite.model, JOINING).items())]
    finally:
        dht.close()
    members, rows = swarm_view(records, layers, num_experts, time.time(),
                               dial_members(records, invite.model, tls, min(args.timeout, 5.0)))
    cut = swarm_cut(manifest, invite) if invite.stages is not None else []
    stage_rows, spans, route, no_route = [], [], [], ""
    if stage_records or cut:  # a stages swarm: every stage dialled from here
        stage_rows, spans, route, no_route = survey_stages(stage_records, invite.model, manifest.block_count(), cut,
                                                           tls, min(args.timeout, 5.0), time.time())
    if args.json:
        print(json.dumps({"model": invite.model, "members": [m.__dict__ for m in members],
                          **stage_json(stage_rows, spans, route), "no_route": no_route,
                          "seeds": [{"address": a, "experts": list(e)} for a, e in seeds],
                          "joining": [{"address": a, "share": text} for a, text in joining],
                          "layers": [{**r.__dict__, "weakest": list(r.weakest)} for r in rows]}))
    else:
        if invite.stages is not None and not members:  # the stages are the members: no workers to cover layers
            print(format_view(invite.model, members, [], (), seeds,
                              title=f"swarm of model {invite.model}: stages, the model cut into {len(cut)} spans",
                              joining=joining))
        else:
            print(format_view(invite.model, members, rows, (), seeds, joining=joining))
        if stage_records or cut:
            print("\n".join(format_stages(stage_rows, spans, route, "route from here", no_route)))
    return 0


def dial_members(records, fingerprint: str, tls, timeout_s: float) -> dict[str, float | str]:
    """{address: the least of 3 PING round trips from here in ms, or why it cannot be dialled} of
    each worker announced, dialled at once (HELLO with the model's fingerprint, as a gateway)."""
    from concurrent.futures import ThreadPoolExecutor

    from moeswarm.transport.ping import ping_worker

    def one(address: str) -> float | str:
        report = ping_worker(address, fingerprint, PINGS, tls, timeout_s)
        return report["rtt_us_min"] / 1000.0 if report["ok"] else report["error"]

    if not records:
        return {}
    with ThreadPoolExecutor(min(16, len(records)), thread_name_prefix="moeswarm-status") as pool:
        return dict(zip(records, pool.map(one, records)))
