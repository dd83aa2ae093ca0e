"""Signed membership on the DHT: forged records neither add nor remove a worker; floods stay bounded.

In-process hivemind DHT nodes on loopback: a keyed meeting point (it validates every record it is
asked to store), an attacker's node (no validator: it stores whatever it likes and answers with it),
and readers. The attacks are those of issue 27: a fake worker announced without a member key or
with another swarm's, a record under an honest worker's subkey saying `online: false` with a later
expiry, a revoked member, and 1,800 records for one fake worker by respelling its address.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

pytest.importorskip("hivemind")

from hivemind.dht.validation import DHTRecord  # noqa: E402
from hivemind.utils import MSGPackSerializer, get_dht_time  # noqa: E402

from moeswarm.discovery.dht import MAX_PER_HOST, SwarmDht  # noqa: E402
from moeswarm.discovery.announce import Announcer  # noqa: E402
from moeswarm.discovery.record import Announcement, Capacity, RecordError, announcement_key  # noqa: E402
from moeswarm.discovery.sign import MemberValidator, key_id, member_subkey, open_record, sign_record  # noqa: E402
from moeswarm.transport.member_cert import Authority, Identity, revoke, write_member  # noqa: E402
from moeswarm.transport.tls import write_swarm_key  # noqa: E402

FINGERPRINT = "f" * 16
HONEST = "127.0.0.1:7001"
FAKE = "127.0.0.1:7666"


def _record(address: str, online: bool = True) -> Announcement:
    return Announcement(address=address, fingerprint=FINGERPRINT, model_type="qwen2_moe", num_experts=8, hidden_size=16,
                        held={0: (0, 1, 2, 3)}, tls=True, capacity=Capacity(4, 64), throughput=1.0, online=online)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    where = tmp_path_factory.mktemp("members")
    swarm, other = write_swarm_key(where / "swarm.key"), write_swarm_key(where / "other.key")
    files = {name: write_member(swarm, name, where / f"{name}.pem") for name in ("gpu-1", "gpu-2", "evil")}
    files["stranger"] = write_member(other, "gpu-1", where / "stranger.pem")  # another swarm's key, the honest name
    return swarm, files


@pytest.fixture(scope="module")
def keyed(keys):
    """(the keyed meeting point, announcing as gpu-1; an unkeyed attacker node joined to it; a keyed reader)."""
    swarm, files = keys
    meeting = SwarmDht.open([], authority=Authority.load(swarm), identity=Identity.load(files["gpu-1"]))
    peer = meeting.addresses()[0]
    attacker = SwarmDht.open([peer])
    reader = SwarmDht.open([peer], client=True, authority=Authority.load(swarm))
    yield meeting, attacker, reader
    for node in (reader, attacker, meeting):
        node.close()


def _forge(attacker: SwarmDht, subkey: str, value: object, ttl_s: float = 120.0) -> None:
    attacker._node.store(announcement_key(FINGERPRINT), subkey=subkey, value=value,
                         expiration_time=get_dht_time() + ttl_s)


def test_forged_records_neither_add_nor_remove_a_worker(keys, keyed):
    swarm, files = keys
    meeting, attacker, reader = keyed
    honest = Identity.load(files["gpu-1"])
    assert meeting.store(_record(HONEST), 60)
    assert set(reader.fetch(FINGERPRINT)) == {HONEST}

    stranger, evil = Identity.load(files["stranger"]), Identity.load(files["evil"])
    key = announcement_key(FINGERPRINT)
    expiry = get_dht_time() + 120
    # a fake worker: unsigned; signed by another swarm's member; signed with the honest certificate but another key
    _forge(attacker, FAKE, _record(FAKE).to_value())
    fake_subkey = member_subkey(stranger.member_id, FAKE)
    attacker._node.store(key, subkey=fake_subkey, expiration_time=expiry,
                         value=sign_record(stranger, key, fake_subkey, _record(FAKE).to_value(), expiry))
    # the honest worker withdrawn, with a later expiry: by a member of the swarm, and with its own certificate copied
    withdrawn = _record(HONEST, online=False).to_value()
    honest_subkey = member_subkey(honest.member_id, HONEST)
    attacker._node.store(key, subkey=honest_subkey, expiration_time=expiry,
                         value=sign_record(evil, key, honest_subkey, withdrawn, expiry))
    copied = sign_record(evil, key, honest_subkey, withdrawn, expiry) | {"cert": honest.certificate_der}
    attacker._node.store(key, subkey=honest_subkey, value=copied, expiration_time=expiry)
    # and a member's own valid record replayed with a later expiry than it signed
    replayed = sign_record(evil, key, member_subkey(evil.member_id, FAKE), _record(FAKE).to_value(), expiry - 60)
    attacker._node.store(key, subkey=member_subkey(evil.member_id, FAKE), value=replayed, expiration_time=expiry)

    for _ in range(3):  # several reads: the attacker's node answers some of them
        records = reader.fetch(FINGERPRINT)
        assert set(records) == {HONEST} and records[HONEST].online
    announcer = Announcer(meeting, _record(HONEST), 60)
    announcer.start()  # the honest worker can still announce itself (the attacker's node refuses it: read back)
    assert set(reader.fetch(FINGERPRINT)) == {HONEST}
    announcer.stop()  # and withdraw itself: only the signer of a subkey replaces it
    assert reader.fetch(FINGERPRINT) == {}
    # what every keyed node says of each forgery (in its DHT process's log, once per cause)
    authority, key_bytes = Authority.load(swarm), key_id(key)
    forgeries = [
        (FAKE, _record(FAKE).to_value(), "subkey '127.0.0.1:7666' is not MEMBER_ID@ADDRESS"),
        (fake_subkey, sign_record(stranger, key, fake_subkey, _record(FAKE).to_value(), expiry),
         "certificate not signed by this swarm's key"),
        (honest_subkey, sign_record(evil, key, honest_subkey, withdrawn, expiry),
         f"stored under member {honest.member_id} by member {evil.member_id} ('evil'): only a subkey's member may write it"),
        (honest_subkey, copied, "bad signature (member 'gpu-1')"),
        (member_subkey(evil.member_id, FAKE), replayed, "bad signature (member 'evil')"),
    ]
    for subkey, value, error in forgeries:
        with pytest.raises(RecordError) as refused:
            open_record(authority, key_bytes, subkey, value, expiry)
        assert str(refused.value) == error
        assert not MemberValidator(authority).validate(
            DHTRecord(key_bytes, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiry))


def test_an_unkeyed_reader_of_a_keyed_swarm_is_told_to_give_the_key(keyed, caplog):
    meeting, _, _ = keyed
    meeting.store(_record(HONEST), 60)  # (the attacker's node, holding a forgery with a later expiry, may say no)
    reader = SwarmDht.open(meeting.addresses(), client=True)
    try:
        with caplog.at_level(logging.WARNING, logger="moeswarm.discovery"):
            assert HONEST not in reader.fetch(FINGERPRINT)  # (the attacker's unsigned fake is: unkeyed readers trust anyone)
    finally:
        reader.close()
    assert "a signed record of a keyed swarm: give --swarm-key to read it" in caplog.text


def test_an_unkeyed_swarm_warns_once(keyed, monkeypatch, capsys):
    from moeswarm.discovery import dht as discovery

    meeting, _, _ = keyed
    monkeypatch.setattr(discovery, "_warned", False)
    capsys.readouterr()
    for _ in range(2):
        SwarmDht.open(meeting.addresses(), client=True).close()
    assert capsys.readouterr().err == (
        "moeswarm: warning: --swarm without --swarm-key: any peer that reaches the DHT can pose as a worker (announce "
        "a fake one, or withdraw a real one); give every member a swarm key (docs/discovery.md)\n")


def test_a_member_claiming_another_workers_address_does_not_keep_it_out(keys, keyed):
    """A certified member may announce any address; when two members claim one, the backbone
    follows the claim the worker's own HELLO confirms (here a stand-in for Members checks it)."""
    from moeswarm.errors import WorkerError
    from moeswarm.discovery.follow import Follower

    swarm, files = keys
    meeting, _, reader = keyed
    honest = Identity.load(files["gpu-1"])
    for attempt in range(64):  # a claimer whose subkey sorts first: its wrong claim is the one read first
        identity = Identity.load(write_member(swarm, "claimer", swarm.parent / f"claimer-{attempt}.pem"))
        if identity.member_id < honest.member_id:
            break
    claimer = SwarmDht.open(meeting.addresses(), authority=Authority.load(swarm), identity=identity)
    try:
        meeting.store(_record(HONEST), 60)
        wrong = dataclasses.replace(_record(HONEST), held={0: (4, 5, 6, 7)})
        assert claimer.store(wrong, 60)
        # both claims are read (the claimer's usually first: its subkey sorts first; under load the
        # suite once read them the other way round, so the order is not asserted)
        assert sorted(str(dict(c.held)) for c in reader.claims(FINGERPRINT)[HONEST]) == \
            sorted([str({0: (4, 5, 6, 7)}), str({0: (0, 1, 2, 3)})])

        class HelloChecking:
            def __init__(self):
                self.joined: dict[str, dict] = {}

            def current(self):
                return dict(self.joined)

            def join(self, record):
                if dict(record.held) != {0: (0, 1, 2, 3)}:
                    raise WorkerError(record.address, "its HELLO announces other experts than its DHT record")
                self.joined[record.address] = dict(record.held)

            def leave(self, address):
                self.joined.pop(address)

            def gaps(self):
                return {}

        members = HelloChecking()
        follower = Follower(reader, FINGERPRINT, members, tls=True, poll_s=0.05)
        deadline = time.monotonic() + 10
        while HONEST not in members.joined and time.monotonic() < deadline:
            follower.step()
            time.sleep(0.05)
        assert members.joined == {HONEST: {0: (0, 1, 2, 3)}}
        for _ in range(3):
            follower.step()  # and it stays: the confirmed claim is kept
        assert members.joined == {HONEST: {0: (0, 1, 2, 3)}}
    finally:
        claimer.close()


def test_a_revoked_member_is_dropped_by_readers(keys, keyed, caplog):
    swarm, files = keys
    meeting, _, reader = keyed
    second = SwarmDht.open(meeting.addresses(), authority=Authority.load(swarm), identity=Identity.load(files["gpu-2"]))
    try:
        assert second.store(_record("127.0.0.1:7002"), 60)
        meeting.store(_record(HONEST), 60)  # (the attacker's node, holding a forgery with a later expiry, may say no)
        assert set(reader.fetch(FINGERPRINT)) == {HONEST, "127.0.0.1:7002"}
        revoke(swarm, files["gpu-2"])
        time.sleep(1.1)  # the list is re-read at most once a second
        with caplog.at_level(logging.WARNING, logger="moeswarm.discovery"):
            assert set(reader.fetch(FINGERPRINT)) == {HONEST}
        assert "member 'gpu-2' (serial " in caplog.text and ") is revoked" in caplog.text
    finally:
        second.close()
        (swarm.parent / "swarm.key.revoked").unlink()


def test_respelled_and_flooded_addresses_add_one_bounded_set_of_workers(caplog):
    """Unkeyed (the flood needs no key): 1,800 records for one fake worker, its address respelled
    (127.1:7730, 0x7f000001:07730, ...), add nothing; 200 records on distinct ports of one host add
    MAX_PER_HOST workers."""
    meeting = SwarmDht.open([])
    try:
        hosts = ["127.1", "127.0.1", "0x7f000001", "0x7f.1", "0177.1", "2130706433", "0177.0.0.1", "127.0.0.01", "0x7F000001"]
        spellings = [f"{host}:{'0' * zeros}7730" for zeros in range(200) for host in hosts][:1800]
        ports = [f"127.0.0.1:{8000 + i}" for i in range(200)]
        pending = [meeting._node.store(announcement_key(FINGERPRINT), subkey=address,
                                       value=_record(address).to_value(), expiration_time=get_dht_time() + 120,
                                       return_future=True) for address in spellings + ports]
        assert all(future.result(timeout=60) for future in pending)
        with caplog.at_level(logging.WARNING, logger="moeswarm.discovery"):
            records = meeting.fetch(FINGERPRINT)
        assert len(records) == MAX_PER_HOST and set(records) <= set(ports)
        lines = caplog.text.splitlines()
        assert any("is not in canonical form ('127.0.0.1:7730') (model ffffffffffffffff)" in line for line in lines)
        assert lines[-1].endswith(f"{1800 + 200 - MAX_PER_HOST} announcements of model {FINGERPRINT} ignored in all "
                                  "(the first 8 causes logged)")
        assert len(lines) == 9  # the flood logs 9 lines, not 1,984
        assert f"ignoring announcements beyond the cap per host 127.0.0.1: {MAX_PER_HOST} workers" in caplog.text
    finally:
        meeting.close()


def test_a_keyed_swarm_uses_the_signed_worker_and_never_the_forged_one(qwen2_moe, keys, tmp_path):
    """Real processes: a worker announcing with its member file; an attacker's node storing a signed-
    looking record of a fake worker (a listening socket that counts who dials it) and the honest
    worker withdrawn with a later expiry. The backbone joins the honest worker only, never dials the
    fake one, and generates exactly what local eager does."""
    import socket
    import threading

    import torch

    from moeswarm.forward.stepper import Stepper
    from moeswarm.local.workers import spawn_worker, stop
    from moeswarm.sources.loading import load_local
    from moeswarm.sources.source import open_source
    from moeswarm.discovery.follow import DiscoveryOptions
    from moeswarm.swarm import open_swarm
    from moeswarm.transport.tls import client_context

    swarm, files = keys
    source = open_source(qwen2_moe)
    meeting = SwarmDht.open([], authority=Authority.load(swarm), identity=Identity.load(swarm))
    peer = meeting.addresses()[0]
    attacker = SwarmDht.open([peer])
    fake = socket.create_server(("127.0.0.1", 0))
    dialled = []
    threading.Thread(target=lambda: dialled.append(fake.accept()), daemon=True).start()
    worker = spawn_worker(qwen2_moe, list(range(8)), extra_args=["--swarm", peer, "--swarm-key", str(files["gpu-1"])])
    try:
        line = ""
        while "announced on the swarm as " not in line:
            line = worker.stdout.readline()
            assert line, worker.stderr.read()[-2000:]
        honest_address = line.split("announced on the swarm as ", 1)[1].split()[0]
        honest, evil = Identity.load(files["gpu-1"]), Identity.load(files["evil"])
        key, expiry = announcement_key(source.fingerprint), get_dht_time() + 300
        fake_address = "127.0.0.1:%d" % fake.getsockname()[1]
        config = source.config
        fake_record = Announcement(address=fake_address, fingerprint=source.fingerprint, model_type="qwen2_moe",
                                   num_experts=config.num_experts, hidden_size=config.hidden_size,
                                   held={layer: tuple(range(8)) for layer in range(config.num_hidden_layers)}, tls=True,
                                   capacity=Capacity(4, 64), throughput=1e9)
        forged = [(member_subkey(evil.member_id, honest_address),  # a member posing at the honest address
                   fake_record.to_value() | {"address": honest_address}),
                  (member_subkey(honest.member_id, honest_address), fake_record.offline().to_value() | {"address": honest_address}),
                  (member_subkey(honest.member_id, fake_address), fake_record.to_value())]
        for subkey, value in forged:
            signed = sign_record(evil, key, subkey, value, expiry)
            attacker._node.store(key, subkey=subkey, value=signed | {"cert": honest.certificate_der}, expiration_time=expiry)
        _forge(attacker, fake_address, fake_record.to_value())
        attacker._node.store(key, subkey=fake_address, value=fake_record.to_value(), expiration_time=expiry)

        local = Stepper(load_local(qwen2_moe))
        options = DiscoveryOptions((peer,), wait_s=120.0, poll_s=0.5, swarm_key=str(files["gpu-2"]))
        with open_swarm(qwen2_moe, [], discovery=options, tls=client_context(files["gpu-2"])) as opened:
            assert opened.members() == [honest_address]
            remote = Stepper(opened.model)
            tokens = [5, 17, 42, 9]
            for _ in range(4):
                got, want = remote.forward(tokens), local.forward(tokens)
                assert torch.equal(got, want)
                tokens = [int(want[-1].argmax())]
            time.sleep(1.5)  # three more polls of the DHT: still only the honest worker
            assert opened.members() == [honest_address]
            assert all(set(call.worker_seconds) == {honest_address} for call in opened.layer_calls())
        assert dialled == []  # the fake worker was never even dialled
    finally:
        stop([worker])
        fake.close()
        attacker.close()
        meeting.close()
