"""Stage members seed their span's pieces to later joiners, with real processes on loopback.

`moeswarm invite --stages 2` on the bundled model; two `join INVITE` take 0-2 and 3-5, each
keeping the pieces it fetched and announcing itself as a seed of its span (node/stage_seed.py).
A third joiner is given the invite with the inviter's seeder address replaced by one where
nothing listens: it takes 0-2 and fetches all of that slice from the two members' seeds (the
span's experts from the first's alone; every piece checked against the manifest). The first joiner stops; `generate --swarm INVITE
--check-local` through the third and the second is bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
from pathlib import Path

from moeswarm.discovery.invite import format_invite, parse_invite
from moeswarm.local.workers import stop
from moeswarm.slices.manifest import load_manifest
from swarm_processes import announced, bundled_copy, cli, lines_until, run


def _join(invite: str, directory: Path) -> subprocess.Popen:
    return cli("join", invite, "--dir", str(directory), "--threads", "1", "--announce-ttl", "60", "--rebalance", "0")


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens there


def _seed_address(lines: list[str]) -> str:
    line = next(line for line in lines if "seeding the span's pieces as " in line)
    return line.split("seeding the span's pieces as ", 1)[1].split()[0]


def test_a_later_joiner_fetches_its_span_from_a_stage_members_seed_with_the_inviters_seeder_gone(tmp_path):
    model = bundled_copy(tmp_path)
    inviter = cli("invite", "--model", str(model), "--stages", "2")
    processes = [inviter]
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        assert invite, inviter.stderr.read()[-3000:]
        manifest = load_manifest(Path(f"{model}.manifest.json"))
        first = _join(invite, tmp_path / "a")
        processes.append(first)
        lines_a = lines_until(first, "announced on the swarm as ")
        second = _join(invite, tmp_path / "b")
        processes.append(second)
        lines_b = lines_until(second, "announced on the swarm as ")
        seed_a = _seed_address(lines_a)
        assert "layers 0-2" in lines_a[-1] and "layers 3-5" in lines_b[-1]

        without_seeder = format_invite(dataclasses.replace(parse_invite(invite), seed=_dead_address()))
        third = _join(without_seeder, tmp_path / "c")
        processes.append(third)
        lines_c = lines_until(third, "announced on the swarm as ")
        assert "layers 0-2" in lines_c[-1]
        fetched_line = next(line for line in lines_c if "fetched " in line)
        fetched = int(fetched_line.split("fetched ", 1)[1].split()[0])
        moe = [layer for layer in manifest.moe_layers() if layer < 3]
        wanted = sum(p.length for p in manifest.pieces(manifest.data["expert_ids"], (moe[0], moe[-1]), True))
        origins = dict(reversed(part.split(" from ")) for part in fetched_line.rsplit(" (", 1)[1].rstrip(")\n").split(", "))
        assert fetched == wanted == sum(map(int, origins.values()))
        # all of it from the members' seeds (the 0-2 member's holds every piece; the 3-5 member's the
        # trunk alone, asked first or not as this joiner's order of the seeds draws)
        assert seed_a in origins and set(origins) <= {seed_a, _seed_address(lines_b)}, origins
        span_experts = sum(p.length for p in manifest.pieces(manifest.data["expert_ids"], (moe[0], moe[-1]), False))
        assert int(origins[seed_a]) >= span_experts - sum(p.length for p in manifest.pieces([], None, False)) > 0
        assert _seed_address(lines_c)  # and it seeds them in turn

        first.terminate()  # its record withdrawn: 0-2 is the third's alone
        first.wait(timeout=60)
        generated = run("generate", "--model", str(model), "--swarm", invite, "--prompt", "def main(",
                        "--max-new-tokens", "6", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        report = json.loads(generated.stdout.strip().splitlines()[-1])
        assert report["bit_identical"] is True and report["positions_checked"] >= 8
        assert (f"stages found on the swarm: layers 0-2 at {announced(lines_c)}, layers 3-5 at {announced(lines_b)}"
                in generated.stderr)
    finally:
        stop(processes)
