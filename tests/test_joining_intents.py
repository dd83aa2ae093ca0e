"""Joiners that start while another is still fetching choose around its share (discovery/joining_record.py).

A joiner stores its choice on the DHT before fetching; a second joiner reading the swarm while the
first is not serving yet (held stopped with SIGSTOP right after choosing) counts it as a holder and
takes the other half of the model (an experts swarm) or the other span (a stages swarm). The
record's parser bounds what the network sends.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from moeswarm.discovery.invite import parse_invite
from moeswarm.discovery.joining import joining_address, joining_holders
from moeswarm.discovery.joining_record import JoiningRecord, parse_joining_record
from moeswarm.discovery.record import RecordError
from moeswarm.errors import MoeSwarmError
from moeswarm.ids import format_ids
from moeswarm.local.workers import stop
from moeswarm.slices.manifest import load_manifest
from swarm_processes import bundled_copy, cli, join, lines_until, share_of, status

HALF = 16  # of the bundled model's 32 experts
FINGERPRINT = "gguf-" + "0" * 32


def test_a_joiner_counts_the_share_another_is_still_fetching(tmp_path):
    model = bundled_copy(tmp_path)
    inviter = cli("invite", "--model", str(model))
    first = second = None
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        parse_invite(invite)
        manifest = load_manifest(Path(f"{model}.manifest.json"))
        first = join(invite, tmp_path / "a", HALF, manifest)
        chose = lines_until(first, "share: experts ")
        first.send_signal(signal.SIGSTOP)  # chosen, announced as joining, not serving
        second = join(invite, tmp_path / "b", HALF, manifest)
        second_chose = lines_until(second, "share: experts ")
        assert "0 members announced" in second_chose[-1] and "1 joining" in second_chose[-1], second_chose[-1]
        assert sorted(share_of(chose) + share_of(second_chose)) == list(range(32))
        shown = status(invite, tmp_path / "status")["joining"]  # `moeswarm status` lists the joiner still fetching
        assert f"experts {format_ids(share_of(chose))}" in [joiner["share"] for joiner in shown], shown
    finally:
        if first is not None and first.poll() is None:
            first.send_signal(signal.SIGCONT)
        stop([p for p in (second, first, inviter) if p is not None])


def test_a_stage_joiner_counts_the_span_another_is_still_fetching(tmp_path):
    """The same in a stages swarm: the second joiner takes the other span, not the first's again."""
    model = bundled_copy(tmp_path)
    inviter = cli("invite", "--model", str(model), "--stages", "2")
    first = second = None
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        parse_invite(invite)
        first = cli("join", invite, "--dir", str(tmp_path / "a"), "--threads", "1")
        chose = lines_until(first, "span: layers ")
        first.send_signal(signal.SIGSTOP)
        second = cli("join", invite, "--dir", str(tmp_path / "b"), "--threads", "1")
        second_chose = lines_until(second, "span: layers ")
        assert "span: layers 0-2 " in chose[-1] and "(stages holding or joining each: 0, 0; 0 joining)" in chose[-1]
        assert "span: layers 3-5 " in second_chose[-1], second_chose[-1]
        assert "(stages holding or joining each: 1, 0; 1 joining)" in second_chose[-1], second_chose[-1]
    finally:
        if first is not None and first.poll() is None:
            first.send_signal(signal.SIGCONT)
        stop([p for p in (second, first, inviter) if p is not None])


def test_joining_records_are_checked_and_counted_in_every_moe_layer():
    record = JoiningRecord("127.0.0.1:4000", FINGERPRINT, (1, 2, 3))
    assert parse_joining_record("127.0.0.1:4000", record.to_value(), FINGERPRINT) == record
    span = JoiningRecord("127.0.0.1:4001", FINGERPRINT, layers=range(8, 16))
    assert parse_joining_record("127.0.0.1:4001", span.to_value(), FINGERPRINT) == span
    assert joining_holders([record, span, record.offline()], [1, 3]) == [({1: (1, 2, 3), 3: (1, 2, 3)}, None)] * 2
    assert joining_address("/ip4/10.0.0.7/tcp/4242/p2p/12D3KooW") == "10.0.0.7:4242"
    with pytest.raises(MoeSwarmError, match="not /ip4 or /ip6 over tcp"):
        joining_address("/dns/example.org/udp/1/quic")


@pytest.mark.parametrize("change, cause", [
    ({"experts": None}, "experts or layers, exactly one"),
    ({"layers": [0, 3]}, "experts or layers, exactly one"),
    ({"experts": "9-2"}, "experts"),
    ({"experts": "1-" + "9" * 20}, "experts"),
    ({"experts": None, "layers": [5, 2]}, "is not [first, last]"),
    ({"online": "yes"}, "online must be true or false"),
    ({"v": 2}, "version"),
    ({"address": "127.0.0.1:4001"}, "stored under"),
])
def test_a_malformed_joining_record_is_refused_by_name(change, cause):
    value = {**JoiningRecord("127.0.0.1:4000", FINGERPRINT, (1, 2)).to_value(), **change}
    with pytest.raises(RecordError, match=cause.replace("[", r"\[")):
        parse_joining_record("127.0.0.1:4000", value, FINGERPRINT)
    with pytest.raises(RecordError, match="fields"):
        parse_joining_record("127.0.0.1:4000", {str(i): i for i in range(17)}, FINGERPRINT)
