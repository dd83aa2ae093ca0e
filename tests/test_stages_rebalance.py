"""A stages swarm healing itself, with real processes on loopback: a span's only stage dies, one
holder of the other span moves there (node/stage_member.py), and the swarm generates bit-identical.

`moeswarm invite --stages 2` on the bundled model; three `join INVITE --rebalance 1` take layers
0-2, 3-5, 0-2. The 3-5 stage is killed (no withdrawal: its record lapses with its TTL); of the two
0-2 stages, the one with the smaller address (placement/stage_move.py) fetches the 3-5 slice,
announces it, withdraws and closes its 0-2 stage, seeds the 3-5 pieces and removes the 0-2 slice
with its kept pieces; the other stays. The
records then hold each span once, and `generate --swarm INVITE --check-local` is bit-identical.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from moeswarm.discovery.invite import parse_invite
from moeswarm.discovery.stage_joining import stage_slice_path
from moeswarm.local.workers import stop
from moeswarm.slices.kept import pieces_paths
from moeswarm.slices.manifest import load_manifest
from swarm_processes import bundled_copy, cli, lines_until, run

TTL_S = "8"  # a killed stage's record lapses within this; live ones are refreshed every third of it
MOVE_WAIT_S = 150.0


def _join(invite: str, directory: Path) -> subprocess.Popen:
    return cli("join", invite, "--dir", str(directory), "--threads", "1", "--announce-ttl", TTL_S,
               "--rebalance", "1")


def _announced(lines: list[str]) -> tuple[str, str]:
    """(address, "A-B") from the stage's announcement line."""
    words = next(line for line in lines if "announced on the swarm as " in line).split("announced on the swarm as ")[1]
    address, _, span = words.split()
    return address, span


def _rest(process: subprocess.Popen) -> str:
    """What the process still writes on its standard output once terminated."""
    process.terminate()
    return process.communicate(timeout=60)[0]


def test_a_holder_of_a_crowded_span_moves_to_the_span_that_lost_its_stage(tmp_path):
    pytest.importorskip("hivemind")
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.discovery.stage_record import STAGES

    model = bundled_copy(tmp_path)
    inviter = cli("invite", "--model", str(model), "--stages", "2")
    processes = [inviter]
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        assert invite, inviter.stderr.read()[-3000:]
        parsed = parse_invite(invite)
        joined = {}
        for name in ("a", "b", "c"):  # one after another: 0-2, 3-5, then 0-2 again
            process = _join(invite, tmp_path / name)
            processes.append(process)
            joined[name] = (process, _announced(lines_until(process, "announced on the swarm as ")))
        assert [span for _, (_, span) in joined.values()] == ["0-2", "3-5", "0-2"]
        (a, (address_a, _)), (b, _), (c, (address_c, _)) = joined.values()

        b.kill()  # the only 3-5 stage dies without a word
        b.wait()
        mover, stayer = (a, c) if address_a < address_c else (c, a)
        directory = tmp_path / ("a" if mover is a else "c")
        lines = lines_until(mover, "moved: layers 3-5 announced as ", MOVE_WAIT_S)
        assert any("rebalancing: layers 3-5 have no stage; moving there from layers 0-2 (held by 2)" in line
                   for line in lines)
        # the move fetched the span's experts and copied the trunk both slices hold from its kept pieces
        copied = [int(line.split(" resumed, ", 1)[1].split()[0]) for line in lines if " copied from the slice held" in line]
        manifest = load_manifest(Path(f"{model}.manifest.json"))
        trunk = sum(p.length for p in manifest.pieces([], None, True))  # the header, samples and every non-expert tensor
        assert len(copied) == 1 and copied[0] >= trunk > 0, (copied, trunk)
        moved_to = lines[-1].split("announced as ", 1)[1].split(";")[0]
        staying = address_c if mover is a else address_a

        dht = SwarmDht.open(list(parsed.dht), client=True)
        try:
            records = {address: (r.layers.start, r.layers.stop) for address, r in
                       dht.fetch(parsed.model, STAGES).items()}
        finally:
            dht.close()
        assert records == {staying: (0, 3), moved_to: (3, 6)}  # the old 0-2 stage withdrawn, the dead one lapsed

        generated = run("generate", "--model", str(model), "--swarm", invite, "--prompt", "def main(",
                        "--max-new-tokens", "6", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        report = json.loads(generated.stdout.strip().splitlines()[-1])
        assert report["bit_identical"] is True and report["positions_checked"] >= 8
        assert f"stages found on the swarm: layers 0-2 at {staying}, layers 3-5 at {moved_to}" in generated.stderr

        assert "moving there" not in _rest(stayer)  # one holder moved, the other stayed
        rest = _rest(mover)
        assert "removed the slice of layers 0-2" in rest and "1 moves" in rest, rest
        assert "seeding the span's pieces as " in rest  # its seed follows the span, once the old stage closed
        old = stage_slice_path(directory, parsed.model, range(0, 3))
        assert not old.exists() and not any(path.exists() for path in pieces_paths(old))
        assert stage_slice_path(directory, parsed.model, range(3, 6)).is_file()
    finally:
        stop(processes)
