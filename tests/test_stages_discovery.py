"""Stages on the DHT: `moeswarm stage --announce-swarm` announces its span, and a gateway with
`--stages-swarm` reads the records, dials each stage (its HELLO must match its record) and builds
the chain with `plan_route` (a pure function: the least cost, round trips plus a weight per
stage, then the fewest stages, then replicas, then the earliest cuts). The real test runs a DHT
node here, two stage processes announcing on it, lying and malformed records beside them, and
`generate --stages-swarm --check-local`: bit-identical to local."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time

import pytest

from moeswarm.discovery.record import RecordError
from moeswarm.discovery.stage_record import STAGES, StageRecord, parse_stage_record, stage_key
from moeswarm.stages.route import CROSSING_MS, Offer, Position, RouteError, plan_route

MODEL = "models/pymoe/hf"  # 6 decoder layers
THREADS = 2  # the stages' and the gateway's threads
WAIT_S = 120.0
FINGERPRINT = "f" * 16


def _offer(address: str, span: str, rtt_ms: float = 0.0) -> Offer:
    first, last = map(int, span.split("-"))
    return Offer(address, range(first, last + 1), rtt_ms)


def _spans(route: list[Position]) -> list[str]:
    return [f"{p.layers.start}-{p.layers.stop - 1}" for p in route]


# -- plan_route ---------------------------------------------------------------------------------------


def test_two_spans_make_a_route_in_layer_order():
    route = plan_route([_offer("b:2", "3-5"), _offer("a:1", "0-2")], 6)
    assert route == [Position(range(0, 3), ("a:1",)), Position(range(3, 6), ("b:2",))]


def test_stages_of_one_span_are_replicas_fastest_first_each_address_once():
    route = plan_route([_offer("a:1", "0-2", 9.0), _offer("a2:1", "0-2", 3.0), _offer("a:1", "0-2", 5.0),
                        _offer("b:2", "3-5")], 6)
    assert route[0].replicas == ("a2:1", "a:1") and route[1].replicas == ("b:2",)


def test_a_gap_is_named():
    with pytest.raises(RouteError, match=r"^no stage holds decoder layers 2-3 of 0-5 \(announced: 0-1, 4-5\)$"):
        plan_route([_offer("a:1", "0-1"), _offer("b:2", "4-5")], 6)
    with pytest.raises(RouteError, match=r"no stage holds decoder layers 0-5 of 0-5 \(none announced\)"):
        plan_route([], 6)
    with pytest.raises(RouteError, match="no stage holds decoder layers 3-5"):
        plan_route([_offer("a:1", "0-2"), _offer("z:1", "3-9")], 6)  # beyond the model: not used


def test_overlapping_spans_that_cannot_tile_are_named():
    with pytest.raises(RouteError, match=r"overlap without tiling decoder layers 0-5: after layers 0-3 none starts "
                                         r"at layer 4 \(announced: 0-3, 2-5\)"):
        plan_route([_offer("a:1", "0-3"), _offer("b:2", "2-5")], 6)


def test_overlapping_spans_that_do_tile_are_used_and_the_rest_left_out():
    route = plan_route([_offer("a:1", "0-3"), _offer("b:2", "2-5"), _offer("c:3", "0-1")], 6)
    assert _spans(route) == ["0-1", "2-5"]


def test_the_least_cost_first_a_stage_counting_its_round_trip_and_the_crossing_weight():
    # CROSSING_MS is 10: one stage at 50 ms (60) costs more than two at 1 ms (22), one at 5 ms (15) less
    offers = [_offer("a:1", "0-2", 1.0), _offer("b:2", "3-5", 1.0), _offer("w:9", "0-5", 50.0)]
    assert _spans(plan_route(offers, 6)) == ["0-2", "3-5"]
    assert plan_route(offers + [_offer("v:8", "0-5", 5.0)], 6) == [Position(range(0, 6), ("v:8", "w:9"))]


def test_then_the_fewest_stages():
    offers = [_offer("a:1", "0-2", 0.0), _offer("b:2", "3-5", 0.0), _offer("w:9", "0-5", 10.0)]  # 20 and 20
    assert _spans(plan_route(offers, 6)) == ["0-5"]


def test_of_as_many_stages_the_lowest_latency():
    offers = [_offer("a:1", "0-2", 10.0), _offer("b:2", "3-5", 10.0), _offer("c:3", "0-3", 1.0),
              _offer("d:4", "4-5", 1.0), _offer("e:5", "4-5", 30.0)]
    route = plan_route(offers, 6)
    assert _spans(route) == ["0-3", "4-5"] and route[1].replicas == ("d:4", "e:5")


def test_then_the_most_replicas_at_the_weakest_position():
    offers = [_offer("a:1", "0-3"), _offer("b:1", "4-5"), _offer("b2:1", "4-5"), _offer("b3:1", "4-5"),
              _offer("c:1", "0-2"), _offer("c2:1", "0-2"), _offer("d:1", "3-5"), _offer("d2:1", "3-5")]
    assert _spans(plan_route(offers, 6)) == ["0-2", "3-5"]  # 2 and 2 replicas beat 1 and 3


def test_then_the_earliest_cuts():
    offers = [_offer("a:1", "0-3"), _offer("b:1", "4-5"), _offer("c:1", "0-2"), _offer("d:1", "3-5")]
    assert _spans(plan_route(offers, 6)) == ["0-2", "3-5"]


def _brute_force(offers: list[Offer], num_layers: int):
    """Every tiling by the announced spans, the least by the documented rules (or None)."""
    spans = sorted({(o.layers.start, o.layers.stop) for o in offers if o.layers.stop <= num_layers})
    replicas = {s: sorted({o.address: o for o in sorted(offers, key=lambda o: -o.rtt_ms)
                           if (o.layers.start, o.layers.stop) == s}.values(), key=lambda o: (o.rtt_ms, o.address))
                for s in spans}
    best = None
    for count in range(1, num_layers + 1):
        for chosen in itertools.permutations(spans, count):
            if chosen[0][0] != 0 or chosen[-1][1] != num_layers or \
                    any(a[1] != b[0] for a, b in zip(chosen, chosen[1:])):
                continue
            key = (sum(replicas[s][0].rtt_ms + CROSSING_MS for s in chosen), count,
                   -min(len(replicas[s]) for s in chosen), tuple(s[1] for s in chosen))
            if best is None or key < best[0]:
                best = (key, chosen)
    return best


def test_the_route_is_the_best_tiling_by_the_rules_against_brute_force():
    rng = random.Random(7)
    for _ in range(400):
        num_layers = rng.randint(1, 7)
        offers = []
        for _ in range(rng.randint(0, 9)):
            start = rng.randint(0, num_layers - 1)
            stop = rng.randint(start + 1, num_layers + 1)  # sometimes beyond the model
            offers.append(Offer(f"h{rng.randint(0, 5)}:1", range(start, stop), float(rng.choice([0, 1, 2, 5]))))
        want = _brute_force(offers, num_layers)
        if want is None:
            with pytest.raises(RouteError):
                plan_route(offers, num_layers)
            continue
        route = plan_route(offers, num_layers)
        assert [(p.layers.start, p.layers.stop) for p in route] == list(want[1]), offers


# -- the stage record -----------------------------------------------------------------------------------


def _value(**change) -> dict:
    value = StageRecord("127.0.0.1:7001", FINGERPRINT, "qwen2_moe", range(3, 6), 16, tls=False).to_value()
    value.update(change)
    return value


def test_a_stage_record_reads_back_as_written():
    record = StageRecord("127.0.0.1:7001", FINGERPRINT, "qwen2_moe", range(3, 6), 16, tls=True)
    assert parse_stage_record("127.0.0.1:7001", record.to_value(), FINGERPRINT) == record
    assert parse_stage_record("127.0.0.1:7001", record.offline().to_value(), FINGERPRINT).online is False
    assert stage_key(FINGERPRINT) != "moeswarm/v1/" + FINGERPRINT and STAGES.key(FINGERPRINT) == stage_key(FINGERPRINT)
    assert len(json.dumps(record.to_value())) < 300  # small


def test_a_stage_record_s_version_and_start_are_optional_bounded_and_read_back():
    """`version` and `started` as a worker's record has them: only in the value when set, read back
    exactly, an older record without them reads as None, each wrong one refused in one line."""
    import dataclasses

    old = StageRecord("127.0.0.1:7001", FINGERPRINT, "qwen2_moe", range(3, 6), 16, tls=False)
    assert {"version", "started"}.isdisjoint(old.to_value())
    read = parse_stage_record("127.0.0.1:7001", old.to_value(), FINGERPRINT)
    assert (read.version, read.started) == (None, None) and read == old
    record = dataclasses.replace(old, version="0.1.0", started=1_800_000_000.5)
    value = record.to_value()
    assert (value["version"], value["started"]) == ("0.1.0", 1_800_000_000.5)
    read = parse_stage_record("127.0.0.1:7001", value, FINGERPRINT)
    assert read == record and (read.version, read.started) == ("0.1.0", 1_800_000_000.5)
    assert parse_stage_record("127.0.0.1:7001", {**value, "started": 1_800_000_000}, FINGERPRINT).started == \
        1_800_000_000.0  # an integer reads as a float
    offline = parse_stage_record("127.0.0.1:7001", record.offline().to_value(), FINGERPRINT)
    assert (offline.online, offline.version, offline.started) == (False, "0.1.0", 1_800_000_000.5)
    for change, message in (({"version": "x" * 65}, "version is not printable text of 1 to 64 characters"),
                            ({"version": "a\x1b[31m"}, "version is not printable text of 1 to 64 characters"),
                            ({"version": 7}, "version is not printable text of 1 to 64 characters"),
                            ({"started": -5}, "started -5 is not a time in Unix seconds"),
                            ({"started": 0}, "started 0 is not a time in Unix seconds"),
                            ({"started": 1 << 40}, f"started {1 << 40} is not a time in Unix seconds"),
                            ({"started": "now"}, "started 'now' is not a time in Unix seconds"),
                            ({"started": True}, "started True is not a time in Unix seconds"),
                            ({"started": float("nan")}, "started nan is not a time in Unix seconds"),
                            ({"started": float("inf")}, "started inf is not a time in Unix seconds")):
        with pytest.raises(RecordError) as refused:
            parse_stage_record("127.0.0.1:7001", {**value, **change}, FINGERPRINT)
        assert str(refused.value) == message


@pytest.mark.parametrize("subkey, value, cause", [
    ("127.0.0.1:7001", b"junk", "a bytes, not a map"),
    ("127.0.0.1:7001", _value(v=2), "stage record version 2"),
    ("127.0.0.1:7002", _value(), "stored under '127.0.0.1:7002' but names address '127.0.0.1:7001'"),
    ("127.1:7001", _value(address="127.1:7001"), "not in canonical form"),
    ("relay://127.0.0.1:9/x", _value(address="relay://127.0.0.1:9/x"), "is not HOST:PORT"),
    ("\x1b[31mevil:1", _value(address="\x1b[31mevil:1"), "address is not printable text"),
    ("127.0.0.1:7001", _value(address="1" * 400), "address is not printable text of 1 to 300 characters"),
    ("127.0.0.1:7001", _value(fingerprint="e" * 16), "under the key of"),
    ("127.0.0.1:7001", _value(layers=[5, 3]), "is not [first, last]"),
    ("127.0.0.1:7001", _value(layers=[-1, 3]), "is not [first, last]"),
    ("127.0.0.1:7001", _value(layers=[True, 3]), "is not [first, last]"),
    ("127.0.0.1:7001", _value(layers=[0, 1 << 40]), "is not [first, last]"),
    ("127.0.0.1:7001", _value(layers="0-5"), "is not [first, last]"),
    ("127.0.0.1:7001", _value(hidden_size=0), "hidden_size 0 is not an integer"),
    ("127.0.0.1:7001", _value(tls="yes"), "tls and online must be true or false"),
    ("127.0.0.1:7001", {**_value(), **{f"x{i}": i for i in range(20)}}, "fields: a stage record has 8 (10 with version and started)"),
])
def test_malformed_stage_records_are_refused_with_their_cause(subkey, value, cause):
    with pytest.raises(RecordError) as refused:
        parse_stage_record(subkey, value, FINGERPRINT)
    assert cause in str(refused.value)
    assert len(str(refused.value)) < 300


# -- on the DHT ---------------------------------------------------------------------------------------


def test_a_keyed_stage_record_is_signed_stored_and_read_only_with_the_key(tmp_path, caplog):
    pytest.importorskip("hivemind")
    from moeswarm.discovery.announce import Announcer
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.transport.member_cert import Authority, Identity, write_member
    from moeswarm.transport.tls import write_swarm_key

    swarm = write_swarm_key(tmp_path / "swarm.key")
    member = write_member(swarm, "stage-1", tmp_path / "stage-1.pem")
    meeting = SwarmDht.open([], authority=Authority.load(swarm), identity=Identity.load(member))
    peer = meeting.addresses()[0]
    reader = SwarmDht.open([peer], client=True, authority=Authority.load(swarm))
    stranger = SwarmDht.open([peer], client=True)
    try:
        record = StageRecord("127.0.0.1:7001", FINGERPRINT, "qwen2_moe", range(0, 3), 16, tls=True)
        announcer = Announcer(meeting, record, 60, kind=STAGES)
        announcer.start()  # the keyed meeting point's validator took the signed stage record
        assert reader.fetch(FINGERPRINT, STAGES) == {"127.0.0.1:7001": record}
        assert reader.fetch(FINGERPRINT) == {}  # the workers' key holds nothing
        assert stranger.fetch(FINGERPRINT, STAGES) == {}
        assert "a signed record of a keyed swarm: give --swarm-key to read it" in caplog.text
        announcer.stop()
        assert reader.fetch(FINGERPRINT, STAGES) == {}  # withdrawn
    finally:
        for node in (stranger, reader, meeting):
            node.close()


class _Claims:
    """A DHT read as the finder sees it: {address: claims}."""

    def __init__(self, records: list[StageRecord]):
        self.records = records

    def claims(self, fingerprint, kind):
        assert kind is STAGES
        found: dict[str, list[StageRecord]] = {}
        for record in self.records:
            found.setdefault(record.address, []).append(record)
        return found


def test_of_several_claims_of_one_address_the_finder_uses_the_one_its_hello_confirms(monkeypatch):
    from types import SimpleNamespace

    from moeswarm.stages.find import StageSearch, _StageFinder

    truth = {"127.0.0.1:7001": range(0, 3), "127.0.0.1:7002": range(3, 6)}  # what each stage's HELLO says

    def probe(self, record):
        return 1.0 if truth.get(record.address) == record.layers else "its HELLO says otherwise"

    monkeypatch.setattr(_StageFinder, "_probe", probe)
    def claim(address: str, layers: range, hidden_size: int = 16) -> StageRecord:
        return StageRecord(address, FINGERPRINT, "qwen2_moe", layers, hidden_size, tls=False,
                           version=f"0.{address[-1]}", started=1_800_000_000.0 + int(address[-1]))

    records = [claim("127.0.0.1:7001", range(0, 6)),  # a member lying about a real stage: would be 1 stage
               claim("127.0.0.1:7001", range(0, 3)), claim("127.0.0.1:7002", range(3, 6)),
               claim("127.0.0.1:7003", range(0, 9)),  # beyond the model
               claim("127.0.0.1:7004", range(3, 6), hidden_size=32)]  # another width
    config = SimpleNamespace(num_hidden_layers=6, hidden_size=16)
    source = SimpleNamespace(fingerprint=FINGERPRINT, config=SimpleNamespace(model_type="qwen2_moe",
                                                                             get_text_config=lambda: config))
    lines = []
    finder = _StageFinder(_Claims(records), StageSearch(("peer",), report=lines.append), source, None)
    assert finder.wait() == [["127.0.0.1:7001"], ["127.0.0.1:7002"]]
    assert lines == ["stages found on the swarm: layers 0-2 at 127.0.0.1:7001, layers 3-5 at 127.0.0.1:7002"]
    # the offers carry what the confirmed records say of their stages (for the /swarm page)
    assert finder.latest == [Offer("127.0.0.1:7001", range(0, 3), 1.0, "0.1", 1_800_000_001.0),
                             Offer("127.0.0.1:7002", range(3, 6), 1.0, "0.2", 1_800_000_002.0)]


def _announced(process: subprocess.Popen) -> str:
    """The address a stage process announced on the swarm, once it says so."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"stage exited: {process.stderr.read()[-2000:]}")
        if "announced on the swarm as " in line:
            return line.split("announced on the swarm as ", 1)[1].split()[0]
    pytest.fail("stage did not announce itself")


def test_generate_finds_two_announced_stages_on_the_dht_and_is_bit_identical():
    pytest.importorskip("hivemind")
    from hivemind.utils import get_dht_time

    from moeswarm.discovery.announce import moeswarm_version
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.sources.source import open_source
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import stop

    fingerprint = open_source(MODEL).fingerprint
    meeting = SwarmDht.open([], host="127.0.0.1")
    peer = meeting.addresses()[0]
    spawned = time.time()
    stages = [spawn_stage(MODEL, span, threads=THREADS, extra_args=["--announce-swarm", peer]) for span in ("0-2", "3-5")]
    try:
        first, second = (_announced(stage) for stage in stages)
        announced = meeting.fetch(fingerprint, STAGES)  # each record says its moeswarm and when it started serving
        for address in (first, second):
            assert announced[address].version == moeswarm_version()
            assert spawned < announced[address].started < time.time()
        # Beside them: a record that would make a 1-stage route if believed, at an address nobody
        # answers; one whose stage's HELLO contradicts it (the second stage, claiming every layer);
        # and garbage with a terminal escape.
        hidden = open_source(MODEL).config.hidden_size
        for address in ("127.0.0.1:1", "localhost:" + second.rpartition(":")[2]):
            assert meeting.store(StageRecord(address, fingerprint, "qwen2_moe", range(0, 6), hidden, tls=False), 60,
                                 kind=STAGES)
        meeting._node.store(stage_key(fingerprint), subkey="\x1b[31mevil", value={"v": 1, "address": "\x1b[31mevil"},
                            expiration_time=get_dht_time() + 60)

        done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt",
                               "def main(", "--json", "--check-local", "--threads", str(THREADS), "--max-new-tokens",
                               "8", "--stages-swarm", peer], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stderr[-3000:], done.stdout[-2000:])
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["bit_identical"] is True and report["positions_checked"] >= 10
        assert f"stages found on the swarm: layers 0-2 at {first}, layers 3-5 at {second}" in done.stderr
        assert "stage 127.0.0.1:1: cannot be reached" in done.stderr
        assert "its HELLO says layers 3-5, its record 0-5" in done.stderr
        assert "\\x1b[31mevil" in done.stderr and "\x1b" not in done.stderr  # peer text escaped

        stages[1].terminate()  # a clean stop withdraws its record at once
        stages[1].wait(30)
        deadline = time.monotonic() + 10
        while second in meeting.fetch(fingerprint, STAGES):
            assert time.monotonic() < deadline, "a stopped stage's record was not withdrawn"
            time.sleep(0.2)
        assert first in meeting.fetch(fingerprint, STAGES)
    finally:
        stop(stages)
        meeting.close()


def test_a_gateway_refuses_with_the_gap_when_the_stages_do_not_tile():
    pytest.importorskip("hivemind")
    from moeswarm.discovery.dht import SwarmDht

    meeting = SwarmDht.open([], host="127.0.0.1")
    try:
        done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt", "x",
                               "--stages-swarm", meeting.addresses()[0], "--stages-wait", "1"],
                              capture_output=True, text=True, timeout=120)
    finally:
        meeting.close()
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "no stage holds decoder layers 0-5 of 0-5 (none announced)" in last and "Traceback" not in done.stderr


def test_a_stage_announced_after_the_start_joins_as_a_replica_and_takes_over_bit_identical():
    """The gateway found one stage per span at start; a replica of the second span announces itself
    later: the watch's next read adds it to the chain, and when the second stage dies the replica
    takes over, replaying the steps, with every logit row equal to the local model's."""
    pytest.importorskip("hivemind")
    import torch

    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.forward.packed import PackedStepper, install
    from moeswarm.sources.loading import load_local
    from moeswarm.sources.source import open_source
    from moeswarm.stages.find import StageSearch, watch_stages
    from moeswarm.stages.gateway import open_gateway
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import stop

    meeting = SwarmDht.open([], host="127.0.0.1")
    peer = meeting.addresses()[0]
    stages = [spawn_stage(MODEL, span, threads=THREADS, extra_args=["--announce-swarm", peer]) for span in ("0-2", "3-5")]
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # the reference computes as the stages do
    try:
        first, second = (_announced(stage) for stage in stages)
        lines: list[str] = []
        search = StageSearch((peer,), report=lines.append, follow_s=0.5)
        watch = watch_stages(search, open_source(MODEL), None)
        assert watch.route == [[first], [second]]
        reference = load_local(MODEL)
        install(reference)
        with open_gateway(MODEL, watch.route, watch=watch) as gateway:
            install(gateway.model)
            chain = gateway.model.base_model.layers[0].chain
            got, want = PackedStepper(gateway.model), PackedStepper(reference)
            feed = list(range(10, 30))
            for _ in range(2):
                out = got.forward(feed)
                assert torch.equal(out, want.forward(feed))
                feed = [int(out[-1].argmax())]

            stages.append(spawn_stage(MODEL, "3-5", threads=THREADS, extra_args=["--announce-swarm", peer]))
            replica = _announced(stages[-1])
            deadline = time.monotonic() + 30
            while replica not in chain.positions[1]:  # the watch's thread reads every 0.5 s
                assert time.monotonic() < deadline, f"the later stage never joined: {lines}"
                time.sleep(0.1)
            assert watch.read_once(chain) == []  # listed once
            assert chain.positions == [[first], [second, replica]]
            assert f"stage {replica} joined as a replica of layers 3-5" in lines

            stages[1].kill()  # the second stage dies between two steps
            stages[1].wait()
            for _ in range(2):
                out = got.forward(feed)
                assert torch.equal(out, want.forward(feed))
                feed = [int(out[-1].argmax())]
            assert chain.failovers == 1 and chain.route == [first, replica]
        assert watch._closed  # closed with the gateway
    finally:
        torch.set_num_threads(before)
        stop(stages)
        meeting.close()
