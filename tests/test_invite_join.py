"""A swarm assembled from one invite, with real processes on loopback and no expert list typed.

`moeswarm invite` seeds the bundled GGUF model; two `moeswarm join INVITE --memory ...` processes
each take half the experts where the swarm is weakest and fetch just those bytes; `generate
--swarm INVITE --check-local` is bit-identical to the model run locally; `status` shows the
coverage; a member that leaves and joins again takes the same share back from its own directory;
`generate --swarm INVITE` without `--model` fetches the backbone alone (the whole model with
`--check-local`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moeswarm.discovery.invite import parse_invite
from moeswarm.slices.manifest import load_manifest
from moeswarm.local.workers import stop
from swarm_processes import bundled_copy, cli, join, lines_until, run, share_of

HALF = 16  # experts of the bundled model's 32 that each joiner's --memory holds


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """(the invite, the model's path, the manifest) of a running `moeswarm invite` on the bundled model."""
    tmp = tmp_path_factory.mktemp("invite")
    model = bundled_copy(tmp)
    inviter = cli("invite", "--model", str(model))
    try:
        first = inviter.stdout.readline()
        assert first, inviter.stderr.read()[-3000:]
        invite = first.rstrip("\n")
        parse_invite(invite)  # the first line is the invite alone
        yield invite, model, load_manifest(Path(f"{model}.manifest.json"))
    finally:
        stop([inviter])


def test_two_joiners_cover_the_model_and_generate_through_the_invite_is_bit_identical(swarm, tmp_path):
    invite, model, manifest = swarm
    first = join(invite, tmp_path / "a", HALF, manifest, "--announce-ttl", "60")
    joiners = [first]
    try:
        lines_a = lines_until(first, "announced on the swarm as ")
        second = join(invite, tmp_path / "b", HALF, manifest, "--announce-ttl", "60")
        joiners.append(second)
        lines_b = lines_until(second, "announced on the swarm as ")
        share_a, share_b = share_of(lines_a), share_of(lines_b)
        assert len(share_a) == len(share_b) == HALF
        assert sorted(share_a + share_b) == list(range(32))  # the second took exactly what nobody held
        for lines, share in ((lines_a, share_a), (lines_b, share_b)):  # exactly the share's pieces, nothing more
            fetched = int(next(line for line in lines if "fetched " in line).split("fetched ", 1)[1].split()[0])
            assert fetched == sum(piece.length for piece in manifest.pieces(share, None, False))

        generated = run("generate", "--model", str(model), "--swarm", invite, "--prompt", "def main(",
                         "--max-new-tokens", "8", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        report = json.loads(generated.stdout.strip().splitlines()[-1])
        assert report["bit_identical"] is True and len(report["workers"]) == 2
        _generate_without_the_model(invite, manifest, tmp_path / "cache", report["tokens"])

        # each member announces the rows its experts computed (at its next refresh: TTL/3 = 20 s)
        deadline = time.monotonic() + 60
        while True:
            status = run("status", invite, "--dir", str(tmp_path / "status"), "--json")
            assert status.returncode == 0, status.stderr[-3000:]
            view = json.loads(status.stdout)
            loads = [member["load"] for member in view["members"]]
            if all(loads) or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert all(load and load > 0 for load in loads), loads  # rows per minute, measured while generating
        assert len(view["members"]) == 2
        assert all(m["version"] and m["uptime_s"] > 0 and m["rtt_ms"] > 0 for m in view["members"]), view["members"]
        assert [row["fewest"] for row in view["layers"]] == [1] * len(manifest.moe_layers())

        # The first member leaves cleanly and joins again: its experts are the uncovered ones, so it takes
        # the same share back and reuses the slice it fetched.
        stop([first])
        again = join(invite, tmp_path / "a", HALF, manifest, "--announce-ttl", "60")
        joiners.append(again)
        lines = lines_until(again, "announced on the swarm as ")
        assert share_of(lines) == share_a
        assert any("reusing " in line for line in lines)
    finally:
        stop(joiners)


def _generate_without_the_model(invite: str, manifest, cache: Path, tokens: list[int]) -> None:
    """`generate --swarm INVITE` with no --model fetches the backbone alone (every tensor but the
    routed experts, exactly those pieces) and gives the tokens of the owner's file; with
    --check-local it fetches the whole model and is bit-identical; run again, it reuses the file."""
    from moeswarm.gguf.gguf_file import GGUFFile

    args = ("generate", "--swarm", invite, "--prompt", "def main(", "--max-new-tokens", "8", "--json", "--threads", "1")
    env = {"XDG_CACHE_HOME": str(cache)}
    plain = run(*args, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert json.loads(plain.stdout.strip().splitlines()[-1])["tokens"] == tokens
    line = next(line for line in plain.stderr.splitlines() if "fetched the backbone" in line)
    assert int(line.split(": ", 2)[2].split()[0]) == sum(p.length for p in manifest.pieces([], None, True))
    path = Path(line.rsplit(" into ", 1)[1])
    assert path.parent == cache / "moeswarm" / "join" / f"{manifest.fingerprint}.backbone"
    assert path.name == manifest.data["file"]  # the owner's file name: the model's id in the API
    backbone = GGUFFile.open(path)
    assert backbone.expert_ids == [] and backbone.fingerprint == manifest.fingerprint
    assert not [name for name in backbone.tensors if "_exps." in name]
    checked = run(*args, "--check-local", env=env)
    assert checked.returncode == 0, checked.stderr[-3000:]
    report = json.loads(checked.stdout.strip().splitlines()[-1])
    assert report["bit_identical"] is True and report["tokens"] == tokens
    assert "fetched the whole model (--check-local)" in checked.stderr
    again = run(*args, env=env)
    assert again.returncode == 0 and "reusing " in again.stderr and "fetched" not in again.stderr


def test_members_started_together_on_one_machine_each_keep_their_own_directory(swarm, tmp_path):
    """Three `join INVITE` at once with nothing else typed (the same share, the default directory):
    each takes a directory of its own and serves; a `--dir` a running member holds is refused in one
    line; a member started again once the others ended gets the first directory back and reuses
    its slice."""
    invite, _, manifest = swarm
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    root = tmp_path / "moeswarm" / "join"
    flags = ("--memory", "1", "--threads", "1", "--announce-ttl", "60")
    joiners = [cli("join", invite, *flags, env=env) for _ in range(3)]
    try:
        lines = [lines_until(joiner, "announced on the swarm as ") for joiner in joiners]
        kept = [Path(next(line for line in each if "keeping the share in " in line).split(" in ", 1)[1].strip()) for each in lines]
        assert sorted(kept) == [root / f"member-{n}" for n in range(3)]
        assert all(share_of(each) == list(range(32)) for each in lines)
        slice_name = f"{manifest.fingerprint}.experts-0-31.gguf"
        assert all((directory / slice_name).is_file() for directory in kept)
        taken = run("join", invite, "--dir", str(root / "member-0"), *flags, timeout=60)
        assert taken.returncode == 2 and "is in use by another running member" in taken.stderr
        assert "Traceback" not in taken.stderr and len(taken.stderr.strip().splitlines()) == 1, taken.stderr
    finally:
        stop(joiners)
    again = cli("join", invite, *flags, env=env)
    try:
        lines = lines_until(again, "announced on the swarm as ")
        assert any(line.rstrip().endswith(f"keeping the share in {root / 'member-0'}") for line in lines), lines
        assert any(f"reusing {root / 'member-0' / slice_name}" in line for line in lines), lines
    finally:
        stop([again])


@pytest.mark.parametrize("args, cause", [
    (["join", "moeswarm-invite-1.not-an-invite"], "the invite does not decode"),
    (["join", "hello"], "not a moeswarm invite"),
    (["status", "moeswarm-invite-9.x"], "version '9'"),
    (["generate", "--model", "m", "--prompt", "x", "--swarm", "moeswarm-invite-1.$"], "outside base64url"),
    (["join", "x", "--memory", "-1"], "must be a positive number of GB"),
    (["generate", "--prompt", "x", "--workers", "127.0.0.1:1"], "give --model (a model directory or .gguf file), or --swarm INVITE"),
    (["invite", "--model", "/nonexistent/m.gguf"], "no such GGUF file"),
])
def test_bad_input_is_one_line_and_status_2(args, cause):
    result = run(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert cause in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_key_that_does_not_fit_the_invite_is_refused_before_any_fetch(swarm, tmp_path):
    invite, _, _ = swarm
    key = tmp_path / "swarm.key"
    assert run("keygen", "-o", str(key)).returncode == 0
    result = run("join", invite, "--swarm-key", str(key), "--dir", str(tmp_path / "j"), timeout=60)
    assert result.returncode == 2 and "the invite is for an unkeyed swarm" in result.stderr
    assert not (tmp_path / "j").exists() or not any((tmp_path / "j").iterdir())


def test_a_keyed_invite_carries_no_key_and_a_member_joins_with_its_own_file(tmp_path):
    """Seeders under mutual TLS, the DHT keyed: a member file of the swarm joins (every expert), a
    backbone with another member file generates bit-identical; the invite holds the certificate's
    hash, never the key."""
    from moeswarm.discovery.inviter import swarm_certificate_hash

    model = bundled_copy(tmp_path)
    key, member, backbone = (str(tmp_path / name) for name in ("swarm.key", "member.pem", "backbone.pem"))
    assert run("keygen", "-o", key).returncode == 0
    for name, path in (("joiner", member), ("gateway", backbone)):
        assert run("keygen", "--member", name, "--swarm-key", key, "-o", path).returncode == 0
    inviter = cli("invite", "--model", str(model), "--swarm-key", key)
    processes = [inviter]
    try:
        text = inviter.stdout.readline().rstrip("\n")
        invite = parse_invite(text)
        assert invite.swarm == swarm_certificate_hash(key) == swarm_certificate_hash(member)
        manifest = load_manifest(Path(f"{model}.manifest.json"))
        unkeyed = run("join", text, "--dir", str(tmp_path / "none"), timeout=60)
        assert unkeyed.returncode == 2 and "keyed swarm: pass your member file" in unkeyed.stderr
        joiner = cli("join", text, "--memory", "1", "--dir", str(tmp_path / "j"), "--threads", "1",
                      "--swarm-key", member)
        processes.append(joiner)
        lines = lines_until(joiner, "announced on the swarm as ")
        assert share_of(lines) == list(range(32))
        assert any("seeding the share's pieces as 127.0.0.1:" in line for line in lines)  # its seed record signed
        generated = run("generate", "--model", str(model), "--swarm", text, "--swarm-key", backbone, "--prompt",
                         "def main(", "--max-new-tokens", "6", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        assert json.loads(generated.stdout.strip().splitlines()[-1])["bit_identical"] is True
        status = run("status", text, "--swarm-key", backbone, "--dir", str(tmp_path / "s"), "--json")
        assert status.returncode == 0, status.stderr[-3000:]
        assert [m["tls"] for m in json.loads(status.stdout)["members"]] == [True]
        assert manifest.fingerprint == invite.model
    finally:
        stop(processes)
