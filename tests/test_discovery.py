"""Discovery on hivemind's DHT, on loopback: workers announce themselves, a backbone finds them and
follows joins and leaves while it generates, bit-identical to local eager throughout.

Real processes: each worker is a `moeswarm worker --swarm PEER` process with its own DHT node;
the first DHT node (the swarm's meeting point) and the backbone run in the test process.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import psutil
import pytest
import torch

from moeswarm.cli import main
from moeswarm.dispatch.membership import LEFT_CAUSE
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import spawn_worker, stop
from moeswarm.sources.loading import load_local
from moeswarm.sources.source import open_source
from moeswarm.discovery.dht import SwarmDht
from moeswarm.discovery.follow import DiscoveryOptions, membership_diff
from moeswarm.discovery.record import Announcement, Capacity, RecordError, announcement_key, parse_record
from moeswarm.swarm import open_swarm

WAIT_S = 120.0  # bounds on waits that take seconds on an idle machine (a worker's start: as conftest's workers)


@pytest.fixture(scope="module")
def bootstrap():
    """The swarm's first DHT node, on loopback."""
    dht = SwarmDht.open([], host="127.0.0.1")
    yield dht
    dht.close()


def _spawn(model: str, experts: list[int], peer: str, ttl_s: float) -> subprocess.Popen:
    return spawn_worker(model, experts, extra_args=["--swarm", peer, "--announce-ttl", str(ttl_s)])


def _announced(process: subprocess.Popen) -> tuple[str, float]:
    """(address, time.monotonic()) once the worker says it announced itself."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"worker exited: {process.stderr.read()[-2000:]}")
        if "announced on the swarm as " in line:
            return line.split("announced on the swarm as ", 1)[1].split()[0], time.monotonic()
    pytest.fail("worker did not announce itself")


def _lockstep(remote: Stepper, local: Stepper):
    """feed(tokens) -> the next greedy token; every step's logits must be torch.equal to local eager's."""
    def feed(tokens: list[int]) -> int:
        got, want = remote.forward(tokens), local.forward(tokens)  # [n, V] each
        assert torch.equal(got, want), f"logits differ from local eager at position {local.length}"
        return int(want[-1].argmax())

    return feed


def _store_malformed(dht: SwarmDht, fingerprint: str, num_experts: int, hidden_size: int) -> None:
    """Three bad entries under the model's key: raw bytes, terminal escapes in the address, and a
    well-formed record of a worker nobody can reach."""
    from hivemind.utils import get_dht_time

    dht._node.store(announcement_key(fingerprint), subkey="junk", value=b"\x00\x01junk", expiration_time=get_dht_time() + 60)
    good = dict(fingerprint=fingerprint, model_type="qwen2_moe", num_experts=num_experts, hidden_size=hidden_size,
                held={0: (0,)}, tls=False, capacity=Capacity(4, 4), throughput=1.0)
    assert dht.store(Announcement(address="\x1b[31mevil:1", **good), 60)
    assert dht.store(Announcement(address="127.0.0.1:1", **good), 60)


def test_backbone_follows_workers_joining_and_leaving_during_a_generation(qwen2_moe, bootstrap, caplog):
    peer = bootstrap.addresses()[0]
    config = open_source(qwen2_moe).config
    _store_malformed(bootstrap, open_source(qwen2_moe).fingerprint, config.num_experts, config.hidden_size)
    # A: experts 0-3, killed outright later (dropped when its 3 s record expires); B: experts 4-7 with a
    # 60 s record, stopped cleanly later (its record withdrawn: dropped long before 60 s).
    a = _spawn(qwen2_moe, [0, 1, 2, 3], peer, 3)
    b = _spawn(qwen2_moe, [4, 5, 6, 7], peer, 60)
    workers = [a, b]
    try:
        local = Stepper(load_local(qwen2_moe))
        (address_a, _), (address_b, _) = _announced(a), _announced(b)
        options = DiscoveryOptions((peer,), wait_s=WAIT_S, poll_s=0.5)
        with caplog.at_level(logging.INFO, logger="moeswarm.discovery"), \
                open_swarm(qwen2_moe, [], discovery=options) as swarm:
            assert sorted(swarm.members()) == sorted([address_a, address_b])
            step = _lockstep(Stepper(swarm.model), local)
            token = step([5, 17, 42, 9])  # the prefill

            # C (every expert) joins mid-generation and gets requests at once.
            c = _spawn(qwen2_moe, list(range(8)), peer, 3)
            workers.append(c)
            address_c, announced_at = _announced(c)
            while address_c not in swarm.members():
                assert time.monotonic() - announced_at < WAIT_S, "the new worker was never joined"
                token = step([token])
                time.sleep(0.05)
            calls = len(swarm.layer_calls())
            token = step([token])
            assert any(address_c in call.worker_seconds for call in swarm.layer_calls()[calls:])

            # A is killed: its experts fail over to C within the layer calls, and A leaves once its record expires.
            helpers = psutil.Process(a.pid).children(recursive=True)  # its DHT node and that node's p2pd
            assert helpers
            a.kill()
            a.wait()
            killed_at = time.monotonic()
            while address_a in swarm.members():
                assert time.monotonic() - killed_at < WAIT_S, "the killed worker was never dropped"
                token = step([token])
                time.sleep(0.1)
            _, alive = psutil.wait_procs(helpers, timeout=20)
            assert not alive, "a killed worker's DHT processes outlived it"

            # B stops cleanly: its record is withdrawn, so it leaves well before its 60 s expiry.
            b.terminate()
            stopped_at = time.monotonic()
            while address_b in swarm.members():
                assert time.monotonic() - stopped_at < 30, "a cleanly stopped worker was kept until its record expired"
                token = step([token])
                time.sleep(0.1)
            for _ in range(3):
                token = step([token])  # C alone now
            assert swarm.members() == [address_c]
            standing = {s["worker"]: s for s in swarm.standing()}
            assert standing[address_a]["cause"] == LEFT_CAUSE and not standing[address_a]["up"]
    finally:
        stop(workers)
    assert "ignoring an announcement under 'junk': a bytes, not a map" in caplog.text
    assert "\\x1b[31mevil:1" in caplog.text and "\x1b" not in caplog.text  # peer text escaped before logging
    assert "cannot use worker 127.0.0.1:1 announced on the swarm" in caplog.text


def test_membership_diff_joins_new_records_and_drops_gone_ones():
    def record(address: str, experts: tuple[int, ...]) -> Announcement:
        return Announcement(address, "fp", "qwen2_moe", 8, 16, {0: experts}, False, Capacity(1, 1), 0.0)

    members = {"a:1": {0: (0, 1)}, "b:1": {0: (2, 3)}, "c:1": {0: (4,)}}
    records = {"a:1": record("a:1", (0, 1)), "c:1": record("c:1", (4, 5)), "d:1": record("d:1", (6,))}
    join, leave = membership_diff(members, records)
    assert leave == ["b:1", "c:1"]  # b's record is gone; c now announces other experts: it leaves and joins again
    assert [r.address for r in join] == ["c:1", "d:1"]


def test_records_from_the_network_are_checked_before_use():
    record = Announcement("10.0.0.7:7000", "fp", "qwen2_moe", 8, 16, {0: (0, 1, 2, 3), 2: (5,)}, True, Capacity(64, 512), 12.5)
    assert parse_record("10.0.0.7:7000", record.to_value(), "fp") == record  # a round trip through the DHT's value
    bad = {
        "v": (2, "record version 2, this moeswarm reads 1"),
        "address": ("x" * 700, "address is not printable text of 1 to 600 characters"),
        "fingerprint": ("other", "fingerprint 'other' under the key of fp"),
        "num_experts": (True, "num_experts True is not an integer in 1-65536"),
        "held": ([[0, "0-3"], [0, "4"]], "held names layer 0 twice"),
        "capacity": ([64, -1], "capacity is not [connections, tokens per dispatch] as two positive integers"),
        "throughput": (float("nan"), "throughput nan is not a finite number >= 0"),
        "tls": ("yes", "tls and online must be true or false"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(RecordError) as caught:
            parse_record("10.0.0.7:7000", {**record.to_value(), field: value}, "fp")
        assert str(caught.value) == message
    with pytest.raises(RecordError, match="layer 2 holds experts outside 0-7"):
        parse_record("10.0.0.7:7000", {**record.to_value(), "held": [[2, "6-8"]]}, "fp")
    with pytest.raises(RecordError, match="stored under 'a:1' but names address '10.0.0.7:7000'"):
        parse_record("a:1", record.to_value(), "fp")


def test_a_record_s_measured_load_is_optional_bounded_and_checked():
    """`load` (rows per minute of each held expert, worker/served.py): a round trip; an old record
    without it reads as before (None); a new record read by the old parser's fields is unchanged;
    every wrong shape is one line."""
    import dataclasses

    record = Announcement("10.0.0.7:7000", "fp", "qwen2_moe", 8, 16, {0: (0, 1, 2, 3), 2: (5,)}, True,
                          Capacity(64, 512), 12.5)
    assert "load" not in record.to_value() and parse_record("10.0.0.7:7000", record.to_value(), "fp").load is None
    loaded = dataclasses.replace(record, load={0: (0, 7, 900, 3), 2: (12,)})
    value = loaded.to_value()
    assert value["load"] == [[0, [0, 7, 900, 3]], [2, [12]]]
    assert parse_record("10.0.0.7:7000", value, "fp") == loaded
    assert parse_record("10.0.0.7:7000", {**value, "load": [[2, [12]]]}, "fp").load == {2: (12,)}  # layers may be left out
    assert loaded.offline().load == loaded.load and not loaded.offline().online
    bad = {
        "held layers only": ([[1, [1]]], "load names layer 1, which is not a held layer or is named twice"),
        "twice": ([[2, [1]], [2, [1]]], "load names layer 2, which is not a held layer or is named twice"),
        "one rate per expert": ([[0, [1, 2]]], "load of layer 0 has 2 rates for 4 held experts (at most 65536 in all)"),
        "integers": ([[2, [True]]], "load of layer 2 has a rate that is not an integer in 0-1099511627776"),
        "not negative": ([[2, [-1]]], "load of layer 2 has a rate that is not an integer in 0-1099511627776"),
        "not huge": ([[2, [1 << 41]]], "load of layer 2 has a rate that is not an integer in 0-1099511627776"),
        "pairs": ([[2, 5]], "load has an entry that is not [layer, [rates]]"),
        "a list": ({"0": 1}, "load is not a list of [layer, rates] pairs, at most one per held layer"),
        "bounded": ([[0, [1] * 4]] * 3, "load is not a list of [layer, rates] pairs, at most one per held layer"),
    }
    for why, (load, message) in bad.items():
        with pytest.raises(RecordError) as caught:
            parse_record("10.0.0.7:7000", {**value, "load": load}, "fp")
        assert str(caught.value) == message, why


def test_a_record_s_version_and_start_are_optional_bounded_and_shown():
    """`version` and `started` (for `status` and /swarm: discovery/member_about.py): a round trip,
    an old record without them reads as None, each wrong one is one line."""
    import dataclasses

    from moeswarm.discovery.member_about import member_about

    record = Announcement("10.0.0.7:7000", "fp", "qwen2_moe", 8, 16, {0: (0, 1)}, False, Capacity(64, 512), 12.5,
                          load={0: (30, 12)})
    assert {"version", "started"}.isdisjoint(record.to_value())
    assert member_about(parse_record("10.0.0.7:7000", record.to_value(), "fp"), 100.0) == {
        "version": None, "uptime_s": None, "tokens_per_s": 12.5, "load": 42}
    about = dataclasses.replace(record, version="0.1.0", started=1_800_000_000.0)
    assert parse_record("10.0.0.7:7000", about.to_value(), "fp") == about
    assert member_about(about, 1_800_000_090.5)["uptime_s"] == 90.5
    assert member_about(about, 1_700_000_000.0)["uptime_s"] == 0.0  # its clock ahead of ours: never below 0
    assert member_about(None, 0.0) == {"version": None, "uptime_s": None, "tokens_per_s": None, "load": None}
    for change, message in (({"version": "x" * 65}, "version is not printable text of 1 to 64 characters"),
                            ({"version": "a\nb"}, "version is not printable text of 1 to 64 characters"),
                            ({"started": -5}, "started -5 is not a time in Unix seconds"),
                            ({"started": "now"}, "started 'now' is not a time in Unix seconds"),
                            ({"started": float("inf")}, "started inf is not a time in Unix seconds")):
        with pytest.raises(RecordError) as caught:
            parse_record("10.0.0.7:7000", {**about.to_value(), **change}, "fp")
        assert str(caught.value) == message


def test_a_seed_record_is_bounded_and_checked():
    """A member's seed record (discovery/seed_record.py): a round trip, and every wrong field one line."""
    from moeswarm.discovery.seed_record import SeedRecord, parse_seed_record

    record = SeedRecord("10.0.0.7:7001", "fp", "ab" * 32, (0, 1, 2, 9), False)
    assert record.to_value()["experts"] == "0-2,9"
    assert parse_seed_record("10.0.0.7:7001", record.to_value(), "fp") == record
    assert not parse_seed_record("10.0.0.7:7001", record.offline().to_value(), "fp").online
    bad = {
        "manifest": ("AB" * 32, f"manifest '{'AB' * 32}' is not a sha256 in lowercase hex"),
        "experts": ("0-3,x", "experts: bad expert list '0-3,x': 'x' is not an expert id or an A-B range "
                             "(expected e.g. 0-3,9,17-20)"),
        "tls": (1, "tls and online must be true or false"),
        "v": (2, "seed record version 2, this moeswarm reads 1"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(RecordError) as caught:
            parse_seed_record("10.0.0.7:7001", {**record.to_value(), field: value}, "fp")
        assert str(caught.value) == message, field
    with pytest.raises(RecordError, match="is not HOST:PORT"):
        relayed = {**record.to_value(), "address": "relay://r:7/n"}
        parse_seed_record("relay://r:7/n", relayed, "fp")
    with pytest.raises(RecordError, match="20 fields"):
        parse_seed_record("10.0.0.7:7001", {**record.to_value(), **{f"x{i}": 0 for i in range(13)}}, "fp")


def test_workers_and_swarm_together_is_one_line_error(qwen2_moe, capsys):
    status = main(["generate", "--model", qwen2_moe, "--workers", "127.0.0.1:1", "--swarm",
                   "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGfYbptK5dv9tZnhD75bw19RrcZoTz6swmHv4xWK8Apx9", "--prompt-ids", "1"])
    assert status == 2
    assert capsys.readouterr().err == ("moeswarm generate: error: give --workers or --swarm, not both: a fixed list of "
                                       "workers, or the swarm to find them on\n")


def test_swarm_without_hivemind_says_how_to_install_it(qwen2_moe):
    """hivemind is optional: the CLI parses and the swarm module imports without it; --swarm says what to install."""
    code = ("import sys; sys.modules['hivemind'] = None\n"  # an import of hivemind now fails as if it were absent
            "import moeswarm.swarm\n"
            "from moeswarm.cli import main\n"
            f"sys.exit(main(['worker', '--model', {qwen2_moe!r}, '--swarm', 'new']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("moeswarm worker: error: --swarm needs hivemind, which is not installed: "
                           "pip install 'moeswarm[swarm]'\n")
