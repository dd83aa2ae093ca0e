"""Rebalancing with real processes on loopback: an inviter and three joiners of the bundled model, each
with memory for half its experts; one joiner is killed (no clean exit: its record expires), and
within a few rebalancing periods a survivor moves part of its share so that every expert has a
holder again, read from the DHT as `moeswarm status` reads it; `generate --swarm INVITE
--check-local` is bit-identical afterwards."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from moeswarm.discovery.invite import parse_invite
from moeswarm.ids import parse_experts
from moeswarm.slices.manifest import load_manifest
from moeswarm.local.workers import stop
from swarm_processes import announced, bundled_copy, cli, join, lines_until, run, share_of, status

HALF = 16  # of the bundled model's 32 experts
TTL_S = "4"  # a killed joiner's record lasts this long
PERIOD = "1"  # seconds between rebalancing rounds
SETTLE_S = 90.0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rebalance")
    model = bundled_copy(tmp)
    inviter = cli("invite", "--model", str(model))
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        parse_invite(invite)
        yield invite, model, load_manifest(Path(f"{model}.manifest.json"))
    finally:
        stop([inviter])


def test_a_killed_member_share_is_taken_over_and_generation_stays_bit_identical(swarm, tmp_path):
    invite, model, manifest = swarm
    joiners, lines = [], []
    try:
        for name in "abc":  # one after another: each chooses its share from the ones announced before it
            joiner = join(invite, tmp_path / name, HALF, manifest, "--rebalance", PERIOD, "--announce-ttl", TTL_S)
            joiners.append(joiner)
            lines.append(lines_until(joiner, "announced on the swarm as "))
        shares = [share_of(found) for found in lines]
        assert sorted(shares[0] + shares[1]) == list(range(32))  # a and b split the model; c doubles some of it
        killed = announced(lines[0])
        joiners[0].kill()  # no withdrawal: the swarm learns it from the record's expiry
        joiners[0].wait()

        deadline, view = time.monotonic() + SETTLE_S, None
        while time.monotonic() < deadline:
            view = status(invite, tmp_path / "status")
            if (killed not in [m["address"] for m in view["members"]]
                    and all(row["fewest"] >= 1 for row in view["layers"])):
                break
            time.sleep(1.0)
        else:
            pytest.fail(f"not every expert covered {SETTLE_S:g} s after a member was killed: {view}")

        generated = run("generate", "--model", str(model), "--swarm", invite, "--prompt", "def main(",
                        "--max-new-tokens", "8", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        assert json.loads(generated.stdout.strip().splitlines()[-1])["bit_identical"] is True
    finally:
        for joiner in joiners[1:]:
            if joiner.poll() is None:
                joiner.terminate()
        said_each = [joiner.communicate(timeout=60)[0] for joiner in joiners[1:]]  # the rest of their lines
        said = "".join(said_each)
        stop(joiners)
    assert said.count("moved: experts ") == 1, said  # one member moved, once
    assert "rebalancing: taking experts " in said and ", then dropping " in said
    assert said.count("seeding the share's pieces as ") == 1, said  # the mover's seed follows its new share
    # the mover's directory keeps the slice (and seed pieces) of the share it moved to, not the one it left
    mover = next(name for name, text in zip("bc", said_each) if "moved: experts " in text)
    new_share = next(line for line in said.splitlines() if "moved: experts " in line).split("moved: experts ")[1].split()[0]
    slices = sorted(path.name for path in (tmp_path / mover).iterdir() if ".experts-" in path.name)
    assert slices and all(f".experts-{new_share.replace(',', '_')}.gguf" in name for name in slices), slices
    assert "removed the slice of the share moved away from" in said
    # the move fetched only the experts it took: the ones it kept were copied from its kept pieces
    taken = parse_experts(re.search(r"rebalancing: taking experts (\S+), then dropping ", said)[1])
    kept = set(parse_experts(new_share)) - set(taken)
    moved = [(int(m[1]), int(m[2])) for m in re.finditer(r"fetched (\d+) bytes \(\d+ resumed, (\d+) copied", said)]
    assert len(moved) == 1 and (moved[0][1] > 0) == bool(kept), (moved, said)
