"""A stages swarm assembled from one invite, with real processes on loopback and no span typed.

`moeswarm invite --stages 2` seeds the bundled GGUF model and says the model is cut into two
spans; two `moeswarm join INVITE` take the two spans (the second the one nobody holds), each
fetching just its slice (its span's experts and the trunk) and serving it as a stage announced on
the DHT; `generate --swarm INVITE --check-local` finds the stages and is bit-identical to the
model run locally.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from moeswarm.bundled import PYMOE
from moeswarm.discovery.announce import moeswarm_version
from moeswarm.discovery.invite import parse_invite
from moeswarm.local.workers import stop
from moeswarm.slices.manifest import load_manifest
from swarm_processes import bundled_copy, cli, lines_until, run, status

@pytest.fixture(scope="module")
def stages_swarm(tmp_path_factory):
    """(the invite, the model's path, the manifest) of a running `moeswarm invite --stages 2`."""
    tmp = tmp_path_factory.mktemp("invite-stages")
    model = bundled_copy(tmp)
    inviter = cli("invite", "--model", str(model), "--stages", "2")
    try:
        first = inviter.stdout.readline()
        assert first, inviter.stderr.read()[-3000:]
        invite = first.rstrip("\n")
        assert parse_invite(invite).stages == 2
        yield invite, model, load_manifest(Path(f"{model}.manifest.json"))
    finally:
        stop([inviter])


def _join(invite: str, directory: Path) -> subprocess.Popen:
    return cli("join", invite, "--dir", str(directory), "--threads", "1", "--announce-ttl", "60")


def _announced(lines: list[str]) -> tuple[str, str]:
    """(address, "A-B") from the stage's announcement line."""
    words = next(line for line in lines if "announced on the swarm as " in line).split("announced on the swarm as ")[1]
    address, _, span = words.split()
    return address, span


@pytest.fixture(scope="module")
def joined(stages_swarm, tmp_path_factory):
    """Two `join INVITE`, the second started once the first announced: (their processes, their
    standard output's lines up to the announcement)."""
    invite = stages_swarm[0]
    tmp = tmp_path_factory.mktemp("joiners")
    joiners = [_join(invite, tmp / "a")]
    try:
        lines = [lines_until(joiners[0], "announced on the swarm as ")]
        joiners.append(_join(invite, tmp / "b"))
        lines.append(lines_until(joiners[1], "announced on the swarm as "))
        yield joiners, lines
    finally:
        stop(joiners)


def test_two_joiners_take_the_two_spans_and_generate_through_the_invite_is_bit_identical(stages_swarm, joined):
    invite, model, manifest = stages_swarm
    lines_a, lines_b = joined[1]
    (first, span_a), (second, span_b) = _announced(lines_a), _announced(lines_b)
    assert (span_a, span_b) == ("0-2", "3-5")  # the first the lowest span, the second the one nobody held
    assert any("stages holding or joining each: 1, 0; 0 joining" in line for line in lines_b)
    for lines, moe in ((lines_a, (0, 2)), (lines_b, (3, 5))):  # exactly the slice's pieces, nothing more
        fetched = int(next(line for line in lines if "fetched " in line).split("fetched ", 1)[1].split()[0])
        assert fetched == sum(p.length for p in manifest.pieces(manifest.data["expert_ids"], moe, True))
        assert fetched < manifest.file_size

    generated = run("generate", "--model", str(model), "--swarm", invite, "--prompt", "def main(",
                     "--max-new-tokens", "8", "--check-local", "--json", "--threads", "1")
    assert generated.returncode == 0, generated.stderr[-3000:]
    report = json.loads(generated.stdout.strip().splitlines()[-1])
    assert report["bit_identical"] is True and report["positions_checked"] >= 10
    assert f"stages found on the swarm: layers 0-2 at {first}, layers 3-5 at {second}" in generated.stderr


def test_status_shows_every_stage_its_round_trip_the_coverage_per_span_and_the_route(stages_swarm, joined, tmp_path):
    invite = stages_swarm[0]
    lines_a, lines_b = joined[1]
    first, second = _announced(lines_a)[0], _announced(lines_b)[0]
    view = status(invite, tmp_path)
    assert [(s["address"], s["layers"], s["in_route"], s["cause"], s["version"]) for s in view["stages"]] == [
        (first, [0, 2], True, "", moeswarm_version()), (second, [3, 5], True, "", moeswarm_version())]
    assert all(isinstance(s["rtt_ms"], float) and s["rtt_ms"] > 0 for s in view["stages"])
    assert all(isinstance(s["uptime_s"], float) and 0 < s["uptime_s"] < 3600 for s in view["stages"])
    assert view["spans"] == [{"layers": [0, 2], "stages": 1, "weakest": True}, {"layers": [3, 5], "stages": 1, "weakest": True}]
    assert view["route"] == [{"layers": [0, 2], "address": first}, {"layers": [3, 5], "address": second}]
    text = run("status", invite, "--dir", str(tmp_path), timeout=120)
    assert text.returncode == 0, text.stderr[-3000:]
    assert f"route from here: layers 0-2 at {first}, layers 3-5 at {second}" in text.stdout
    assert "  layers 3-5      1 stage  <- weakest" in text.stdout and "2 stages announced:" in text.stdout
    assert text.stdout.startswith(f"swarm of model {parse_invite(invite).model}: stages, the model cut into 2 spans\n")
    lines = text.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["ADDRESS", "LAYERS", "VERSION"])
    assert lines[header].split() == ["ADDRESS", "LAYERS", "VERSION", "UP", "RTT", "MS", "ROUTE"]
    for line, (address, layers) in zip(lines[header + 1:header + 3], ((first, "0-2"), (second, "3-5"))):
        cells = line.split()
        assert cells[:3] == [address, layers, moeswarm_version()] and cells[-2:] == ["in", "use"], line
        assert re.fullmatch(r"\d+s|\d+m", cells[3]), line  # its uptime: started serving within the test
        assert float(cells[4]) > 0, line
    assert "coverage per MoE layer" not in text.stdout and "UNCOVERED" not in text.stdout  # no workers: not theirs


def test_a_late_joiner_is_picked_up_by_a_running_gateway_and_takes_over_bit_identical(stages_swarm, joined,
                                                                                        tmp_path):
    """A gateway runs on the two joiners; a third `join INVITE` takes layers 0-2 (both spans held
    once: the lowest), the gateway's watch adds it as that span's replica, the first joiner is
    killed, and the late joiner takes over with the steps replayed, every logit row equal."""
    pytest.importorskip("hivemind")
    import torch

    from moeswarm.forward.packed import PackedStepper, install
    from moeswarm.sources.loading import load_local
    from moeswarm.sources.source import open_source
    from moeswarm.stages.find import StageSearch, watch_stages
    from moeswarm.stages.gateway import open_gateway

    invite, model, _ = stages_swarm
    (first_process, _), (lines_a, lines_b) = joined
    first, second = _announced(lines_a)[0], _announced(lines_b)[0]
    torch.set_num_threads(1)  # the reference computes as the stages do
    said: list[str] = []
    watch = watch_stages(StageSearch(parse_invite(invite).dht, report=said.append, follow_s=0.5),
                         open_source(str(model)), None)
    assert watch.route == [[first], [second]]
    reference = load_local(str(model))
    install(reference)
    late = _join(invite, tmp_path / "c")
    try:
        with open_gateway(str(model), watch.route, watch=watch) as gateway:
            install(gateway.model)
            chain = gateway.model.base_model.layers[0].chain
            got, want = PackedStepper(gateway.model), PackedStepper(reference)
            feed = list(range(10, 30))
            for _ in range(2):
                out = got.forward(feed)
                assert torch.equal(out, want.forward(feed))
                feed = [int(out[-1].argmax())]
            lines_c = lines_until(late, "announced on the swarm as ")
            third, span = _announced(lines_c)
            assert span == "0-2" and any("stages holding or joining each: 1, 1; 0 joining" in line for line in lines_c)
            deadline = time.monotonic() + 30
            while third not in chain.positions[0]:
                assert time.monotonic() < deadline, f"the late joiner never joined the chain: {said}"
                time.sleep(0.1)
            first_process.kill()  # the first joiner dies between two steps
            first_process.wait()
            for _ in range(2):
                out = got.forward(feed)
                assert torch.equal(out, want.forward(feed))
                feed = [int(out[-1].argmax())]
            assert chain.failovers == 1 and chain.route == [third, second]
    finally:
        stop([late])


@pytest.mark.parametrize("args, cause", [
    (["invite", "--model", str(PYMOE / "gguf" / "pymoe-Q4_K_M.gguf"), "--stages", "2", "--experts-only"],
     "not allowed with argument --stages"),
    (["invite", "--model", str(PYMOE / "gguf" / "pymoe-Q4_K_M.gguf"), "--stages", "0"], "must be at least 1"),
])
def test_bad_flags_are_one_line_and_status_2(args, cause):
    result = run(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert cause in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_more_stages_than_layers_and_a_relay_for_a_stage_are_one_line(stages_swarm, tmp_path):
    _, model, _ = stages_swarm
    result = run("invite", "--model", str(model), "--stages", "7", timeout=60)
    assert result.returncode == 2 and "--stages 7: the model has 6 decoder layers, so 1 to 6 stages" in result.stderr
    assert "Traceback" not in result.stderr
    invite = stages_swarm[0]
    result = run("join", invite, "--relay", "127.0.0.1:9", "--dir", str(tmp_path / "r"), timeout=60)
    assert result.returncode == 2 and "a stage is dialled directly" in result.stderr, result.stderr


def _parsed(argv: list[str]):
    from moeswarm.cli import build_parser

    return build_parser(argv).parse_args(argv)


def test_swarm_invite_of_a_stages_swarm_stands_for_stages_swarm_or_announce_swarm():
    from moeswarm.commands._swarm import check_workers_or_swarm
    from moeswarm.discovery.invite import Invite, format_invite
    from moeswarm.errors import MoeSwarmError

    peers = ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWExample"]
    experts = Invite(tuple(peers), "fp0123", "a" * 64, 1234, "127.0.0.1:7000", "127.0.0.1:7001")
    GOLDEN, STAGES_GOLDEN = format_invite(experts), format_invite(Invite(**{**experts.__dict__, "stages": 2}))
    for command in ("generate", "serve"):
        extra = ["--prompt", "x"] if command == "generate" else []
        args = _parsed([command, "--model", "m", *extra, "--swarm", STAGES_GOLDEN])
        check_workers_or_swarm(args)
        assert args.stages_swarm == peers and args.swarm is None  # routed through the swarm's stages
        args = _parsed([command, "--model", "m", *extra, "--swarm", GOLDEN])
        check_workers_or_swarm(args)
        assert args.swarm == peers and args.stages_swarm is None  # an experts swarm's: its workers
        args = _parsed([command, "--model", "m", *extra, "--swarm", STAGES_GOLDEN, "--stages-swarm", GOLDEN])
        with pytest.raises(MoeSwarmError, match="stands for --stages-swarm INVITE: give one of them"):
            check_workers_or_swarm(args)
    args = _parsed(["stage", "--model", "m", "--layers", "0-2", "--swarm", STAGES_GOLDEN])
    check_workers_or_swarm(args)
    assert args.announce_swarm == peers and args.swarm is None  # announced there, its experts its own
    keyed = format_invite(Invite(**{**experts.__dict__, "stages": 2, "swarm": "b" * 64}))
    for argv in (["generate", "--model", "m", "--prompt", "x", "--swarm", keyed], ["serve", "--model", "m", "--swarm", keyed],
                 ["stage", "--model", "m", "--layers", "0-2", "--swarm", keyed]):
        with pytest.raises(MoeSwarmError, match="the invite is for a keyed swarm: pass your member file"):
            check_workers_or_swarm(_parsed(argv))  # at once, not after waiting for records it cannot read


def test_a_keyed_stages_swarm_joins_members_only_and_generates_bit_identical(tmp_path):
    """`invite --stages 2 --swarm-key KEY`: a joiner without a member file is refused in one line;
    two members join (the two spans, TLS stages, signed records), `generate --swarm INVITE
    --swarm-key` with a third member file finds both and is bit-identical; `status` with the key
    dials both over TLS and shows the route."""
    model = bundled_copy(tmp_path)
    key, one, two, gateway = (str(tmp_path / name) for name in ("swarm.key", "one.pem", "two.pem", "gateway.pem"))
    assert run("keygen", "-o", key).returncode == 0
    for name, path in (("one", one), ("two", two), ("gateway", gateway)):
        assert run("keygen", "--member", name, "--swarm-key", key, "-o", path).returncode == 0
    inviter = cli("invite", "--model", str(model), "--stages", "2", "--swarm-key", key)
    processes = [inviter]
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        assert invite, inviter.stderr.read()[-3000:]
        assert parse_invite(invite).stages == 2 and parse_invite(invite).swarm is not None
        unkeyed = run("join", invite, "--dir", str(tmp_path / "none"), timeout=60)
        assert unkeyed.returncode == 2 and "keyed swarm: pass your member file" in unkeyed.stderr
        assert len(unkeyed.stderr.strip().splitlines()) == 1 and "Traceback" not in unkeyed.stderr
        other, stranger = str(tmp_path / "other.key"), str(tmp_path / "stranger.pem")
        assert run("keygen", "-o", other).returncode == 0
        assert run("keygen", "--member", "stranger", "--swarm-key", other, "-o", stranger).returncode == 0
        foreign = run("join", invite, "--swarm-key", stranger, "--dir", str(tmp_path / "f"), timeout=60)
        assert foreign.returncode == 2 and "belongs to another swarm" in foreign.stderr
        assert len(foreign.stderr.strip().splitlines()) == 1 and "Traceback" not in foreign.stderr
        announced = []
        for name, member in (("a", one), ("b", two)):
            processes.append(cli("join", invite, "--dir", str(tmp_path / name), "--threads", "1", "--announce-ttl", "60",
                                 "--swarm-key", member))
            announced.append(_announced(lines_until(processes[-1], "announced on the swarm as ")))
        (first, span_a), (second, span_b) = announced
        assert (span_a, span_b) == ("0-2", "3-5")

        generated = run("generate", "--model", str(model), "--swarm", invite, "--swarm-key", gateway, "--prompt",
                        "def main(", "--max-new-tokens", "8", "--check-local", "--json", "--threads", "1")
        assert generated.returncode == 0, generated.stderr[-3000:]
        report = json.loads(generated.stdout.strip().splitlines()[-1])
        assert report["bit_identical"] is True and report["positions_checked"] >= 10
        assert f"stages found on the swarm: layers 0-2 at {first}, layers 3-5 at {second}" in generated.stderr

        keyed = run("status", invite, "--swarm-key", gateway, "--dir", str(tmp_path / "s"), "--json", timeout=120)
        assert keyed.returncode == 0, keyed.stderr[-3000:]
        view = json.loads(keyed.stdout)
        assert [(s["address"], s["in_route"], s["cause"]) for s in view["stages"]] == [(first, True, ""), (second, True, "")]
        assert all(isinstance(s["rtt_ms"], float) for s in view["stages"])
        for command in (["status", invite, "--dir", str(tmp_path / "s2")],
                        ["generate", "--model", str(model), "--swarm", invite, "--prompt", "x", "--threads", "1"]):
            unkeyed = run(*command, timeout=120)
            assert unkeyed.returncode == 2, unkeyed.stderr[-3000:]
            assert len(unkeyed.stderr.strip().splitlines()) == 1 and "Traceback" not in unkeyed.stderr, unkeyed.stderr
    finally:
        stop(processes)
