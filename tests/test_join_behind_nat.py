"""A member that cannot be dialled joins from an invite and serves through a relay.

The swarm is keyed (a relay must not read the hidden states). The inviter and the relay listen on
the host's side of a veth pair (tests/netns.py); one joiner runs here, on loopback, the other
inside a network namespace: it can dial the DHT, the seeders and the relay, but its own address
cannot be dialled from here. Both choose their shares from the invite alone (half the experts
each, no expert list typed); `generate --swarm INVITE --check-local` reaches the second through
the relay and is bit-identical to the model run locally.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeswarm.discovery.invite import parse_invite
from moeswarm.local.workers import stop
from moeswarm.slices.manifest import load_manifest
from netns import inside, namespace  # noqa: F401  (namespace: a fixture)
from swarm_processes import bundled_copy, cli, lines_until, run, share_of

HALF = 16  # of the bundled model's 32 experts


def _memory(manifest) -> str:
    return f"{(HALF + 0.5) * manifest.expert_bytes() / 1e9:.9f}"


def test_a_joiner_that_cannot_be_dialled_serves_through_the_relay_and_generate_is_bit_identical(
        namespace, tmp_path):
    model = bundled_copy(tmp_path)
    key, here, there, gateway = (str(tmp_path / name) for name in ("swarm.key", "here.pem", "there.pem", "gw.pem"))
    assert run("keygen", "-o", key).returncode == 0
    for name, path in (("here", here), ("there", there), ("gateway", gateway)):
        assert run("keygen", "--member", name, "--swarm-key", key, "-o", path).returncode == 0
    inviter = cli("invite", "--model", str(model), "--swarm-key", key, "--host", namespace.here)
    processes = [inviter]
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        assert invite, inviter.stderr.read()[-3000:]
        parse_invite(invite)
        manifest = load_manifest(Path(f"{model}.manifest.json"))
        relay = cli("relay", "--host", namespace.here, "--port", "0")
        processes.append(relay)
        relay_at = relay.stdout.readline().split("listening on ", 1)[1].split()[0]

        first = cli("join", invite, "--memory", _memory(manifest), "--dir", str(tmp_path / "a"), "--threads", "1",
                    "--swarm-key", here)
        processes.append(first)
        share_here = share_of(lines_until(first, "announced on the swarm as "))
        behind = inside(namespace, "join", invite, "--memory", _memory(manifest), "--dir", str(tmp_path / "b"),
                        "--threads", "1", "--swarm-key", there, "--host", namespace.inside, "--relay", relay_at,
                        "--relay-name", "behind-nat", "--no-seed")
        processes.append(behind)
        lines = lines_until(behind, "announced on the swarm as ")
        share_there = share_of(lines)
        assert sorted(share_here + share_there) == list(range(32))  # the second took what nobody held
        assert any(f"reachable through relay://{relay_at}/behind-nat" in line for line in lines), lines

        generated = run("generate", "--model", str(model), "--swarm", invite, "--swarm-key", gateway, "--prompt",
                        "def main(", "--max-new-tokens", "6", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        report = json.loads(generated.stdout.strip().splitlines()[-1])
        assert report["bit_identical"] is True
        assert f"relay://{relay_at}/behind-nat" in report["workers"], report["workers"]
        assert len(report["workers"]) == 2
    finally:
        stop(processes)
