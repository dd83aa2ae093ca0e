"""One N of `moeswarm bench swarm`: a fresh swarm of the model, its N joins one after another, the
stream through K kills and rejoins; every process stopped after, and the run's slices removed.

`moeswarm invite --model M` starts the swarm (DHT node, seeders); N `moeswarm join INVITE` processes
follow one after another, each with `--memory` for ceil(R x E / N) experts, so each chooses its
share from the announcements made before it. The stream (swarm_stream.py) is a backbone in this
process that finds the workers on the swarm as `generate --swarm INVITE` does."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

from moeswarm_bench.bench.swarm_churn import churn
from moeswarm_bench.bench.swarm_coverage import Coverage
from moeswarm_bench.bench.swarm_joins import experts_each, join_row
from moeswarm_bench.bench.swarm_model import Reference, manifest_of
from moeswarm_bench.bench.swarm_procs import Joiner, Process, fetches_of, make_keys, start_inviter
from moeswarm_bench.bench.swarm_settings import Settings
from moeswarm_bench.bench.swarm_stream import Stream
from moeswarm_bench.bench.swarm_targets import targets
from moeswarm_bench.bench.swarm_windows import stream_row

STEADY_TOKENS = 48  # the stream's tokens before the first kill and after the last rejoin


def run_joiners(path: Path, count: int, settings: Settings, reference: Reference, directory: Path, say) -> dict:
    """One N: the swarm, its joins, the stream through K kills and rejoins; every process stopped after."""
    from moeswarm.discovery.invite import parse_invite

    directory.mkdir(parents=True)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    names = [f"j{i + 1}" for i in range(count)]
    keys = make_keys(directory, ["inviter", "stream", *names]) if settings.keyed else {}
    processes: list[Process] = []
    joiners: list[Joiner] = []
    dht = swarm = stream = None
    try:
        inviter, text = start_inviter(path, directory, keys.get("inviter"))
        processes.append(inviter)
        invite = parse_invite(text)
        manifest = manifest_of(path)
        num_experts, layers = len(manifest.data["expert_ids"]), manifest.moe_layers()
        each = experts_each(count, num_experts, settings.replicas)
        memory_gb = (each + 0.5) * manifest.expert_bytes() / 1e9
        flags = ["--rebalance", f"{settings.rebalance_s:g}", "--announce-ttl", f"{settings.ttl_s:g}"]
        joins = []
        for name in names:  # one after another: each chooses its share from those announced before it
            joiner = Joiner(name, text, directory / name, memory_gb, flags, keys.get(name))
            joiners.append(joiner)
            joiner.start()
            figures = joiner.serving()
            joins.append(join_row(joiner, figures, invite.manifest_bytes, manifest.expert_bytes()))
            say(f"  {name} serves experts {len(figures.share)} of {num_experts}, "
                f"{figures.announced_at - figures.started:.1f} s after it started")
        dht = open_dht(invite, keys.get("stream"))
        view = Coverage(dht, invite.model, layers, num_experts)
        initial = view.wait(lambda c: {j.address_now() for j in joiners} <= c.members, 60.0)
        swarm = open_stream_swarm(path, invite, keys.get("stream"))
        stream = Stream(swarm, reference.prompt, reference.tokens, reference.model)
        stream.start()
        stream.wait_tokens(STEADY_TOKENS)
        events, spans = churn(joiners, view, stream, initial, settings, random.Random(settings.seed * 1000 + count),
                              manifest.expert_bytes(), say)
        stream.wait_tokens(STEADY_TOKENS)
        figures = stream.stop()
        resilience = swarm.resilience()
        moves = [(joiner.name, move) for joiner in joiners for move in joiner.moves()]
    finally:
        if stream is not None:
            stream.abort()
        if swarm is not None:
            swarm.close()
        if dht is not None:
            dht.close()
        stopping = [joiner.life for joiner in joiners] + processes
        for process in stopping:  # all at once: each withdraws its record, which takes a DHT store
            process.terminate()
        for process in stopping:
            process.stop()
    move_bytes = sum(f.fetched_bytes for joiner in joiners for life in joiner.lives for f in fetches_of(life)[1:])
    run = {"joiners": count, "experts_each": each, "memory_gb": memory_gb, "joins": joins,
           "initial": initial.to_json(), "kills": events,
           "stream": stream_row(figures, spans, joiners, num_experts, reference, resilience),
           "moves": len(moves), "moves_by": [{"joiner": name, "share": list(m.share)} for name, m in moves],
           "move_fetched_bytes": move_bytes, "seconds": time.monotonic() - started,
           "load": {"before": load_before, "after": os.getloadavg()[0]}}
    run["targets"] = targets(run)
    shutil.rmtree(directory, ignore_errors=True)  # the slices: a real-size model's are gigabytes
    return run


def open_dht(invite, key: Path | None):
    from moeswarm.discovery.dht import SwarmDht

    authority = None
    if key is not None:
        from moeswarm.transport.member_cert import Authority

        authority = Authority.load(key)
    return SwarmDht.open(list(invite.dht), client=True, authority=authority)


def open_stream_swarm(path: Path, invite, key: Path | None):
    from moeswarm.commands._tls import client_tls
    from moeswarm.discovery.follow import DiscoveryOptions
    from moeswarm.swarm import open_swarm
    from moeswarm.swarm_config import SwarmConfig

    key_file = str(key) if key is not None else None
    discovery = DiscoveryOptions(tuple(invite.dht), 120.0, report=lambda line: None, swarm_key=key_file)
    return open_swarm(str(path), [], SwarmConfig(tls=client_tls(key_file), discovery=discovery))
