"""Joiners seed pieces to each other, with real processes on loopback.

An inviter of the bundled GGUF model; a first joiner takes every expert, keeps the pieces it
fetched and announces itself as a seed (node/member_seed.py). A second joiner is given the same
invite with the inviter's seeder address replaced by one where nothing listens (the inviter's
seeder gone): it fetches its whole share from the first joiner's seed (slices/sources.py), every
piece checked against the manifest, its slice byte for byte what `moeswarm slice` cuts from the
model, and `generate --swarm INVITE --check-local` through both is bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
import socket

from swarm_processes import join, lines_until, run, share_of
from test_invite_join import swarm  # noqa: F401 - the fixture

from moeswarm.discovery.invite import format_invite, parse_invite
from moeswarm.gguf.gguf_slice import write_slice
from moeswarm.local.workers import stop

ALL = 32  # the bundled model's experts
HALF = 16


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens there


def test_a_second_joiner_fetches_its_share_from_the_first_with_the_inviters_seeder_gone(swarm, tmp_path):
    invite, model, manifest = swarm
    first = join(invite, tmp_path / "a", ALL, manifest, "--announce-ttl", "60")
    joiners = [first]
    try:
        lines_a = lines_until(first, "announced on the swarm as ")
        seed_line = next(line for line in lines_a if "seeding the share's pieces as " in line)
        seed_address = seed_line.split("seeding the share's pieces as ", 1)[1].split()[0]
        assert share_of(lines_a) == list(range(ALL))

        without_seeder = format_invite(dataclasses.replace(parse_invite(invite), seed=_dead_address()))
        second = join(without_seeder, tmp_path / "b", HALF, manifest, "--announce-ttl", "60")
        joiners.append(second)
        lines_b = lines_until(second, "announced on the swarm as ")
        share_b = share_of(lines_b)
        assert len(share_b) == HALF
        fetched_line = next(line for line in lines_b if "fetched " in line)
        fetched = int(fetched_line.split("fetched ", 1)[1].split()[0])
        wanted = sum(piece.length for piece in manifest.pieces(share_b, None, False))
        assert fetched == wanted and f"({wanted} from {seed_address})" in fetched_line  # all of it from the seed
        slice_b = next((tmp_path / "b").glob("*.experts-*.gguf"))
        write_slice(model, tmp_path / "expected.gguf", share_b)
        assert slice_b.read_bytes() == (tmp_path / "expected.gguf").read_bytes()

        generated = run("generate", "--model", str(model), "--swarm", invite, "--prompt", "def main(",
                         "--max-new-tokens", "8", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        report = json.loads(generated.stdout.strip().splitlines()[-1])
        assert report["bit_identical"] is True and len(report["workers"]) == 2

        status = run("status", invite, "--dir", str(tmp_path / "status"), "--json")
        assert status.returncode == 0, status.stderr[-3000:]
        seeds = {seed["address"]: seed["experts"] for seed in json.loads(status.stdout)["seeds"]}
        assert seeds[seed_address] == list(range(ALL)) and len(seeds) == 2  # the second seeds its share too
        assert sorted(seeds.values()) == sorted([list(range(ALL)), share_b])
    finally:
        stop(joiners)
