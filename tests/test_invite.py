"""The invite string (discovery/invite.py): pinned bytes, a round trip, and one clear line for each bad one."""

from __future__ import annotations

import base64
import json

import pytest

from moeswarm.discovery.invite import Invite, InviteError, format_invite, looks_like_invite, parse_invite

INVITE = Invite(("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWExample",), "fp0123", "a" * 64, 1234, "127.0.0.1:7000",
                "127.0.0.1:7001", None)
GOLDEN = ("moeswarm-invite-1.eyJkaHQiOlsiL2lwNC8xMjcuMC4wLjEvdGNwLzQwMDEvcDJwLzEyRDNLb29XRXhhbXBsZSJdLCJtYW5pZmVzdCI6"
          "ImFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWEiLCJtYW5pZmVzdF9ieXRlcyI6"
          "MTIzNCwibWFuaWZlc3Rfc2VlZCI6IjEyNy4wLjAuMTo3MDAxIiwibW9kZWwiOiJmcDAxMjMiLCJzZWVkIjoiMTI3LjAuMC4xOjcwMDAiLCJzd2Fy"
          "bSI6bnVsbH0")


def _encoded(value) -> str:
    return "moeswarm-invite-1." + base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


def test_the_format_is_pinned_and_reads_back():
    assert format_invite(INVITE) == GOLDEN
    assert parse_invite(GOLDEN) == INVITE
    keyed = Invite(INVITE.dht * 2, INVITE.model, INVITE.manifest, 5, INVITE.seed, INVITE.manifest_seed, "b" * 64)
    assert parse_invite("  " + format_invite(keyed) + "\n") == keyed
    assert looks_like_invite(GOLDEN) and not looks_like_invite("/ip4/127.0.0.1/tcp/1/p2p/X")


@pytest.mark.parametrize("text, cause", [
    ("hello", "not a moeswarm invite"),
    ("moeswarm-invite-2.abc", "version '2'"),
    ("moeswarm-invite-1.abc$", "outside base64url"),
    ("moeswarm-invite-1.a", "does not decode"),
    ("moeswarm-invite-1." + "A" * 5000, "over the 4096"),
    (_encoded([1, 2]), "JSON object"),
    (_encoded({**INVITE.to_json(), "extra": 1}), "unknown ['extra']"),
    (_encoded({k: v for k, v in INVITE.to_json().items() if k != "seed"}), "missing ['seed']"),
    (_encoded({**INVITE.to_json(), "dht": []}), "1 to 8 multiaddrs"),
    (_encoded({**INVITE.to_json(), "dht": ["127.0.0.1:5"]}), "not a multiaddr"),
    (_encoded({**INVITE.to_json(), "manifest": "A" * 64}), "manifest is not a sha256"),
    (_encoded({**INVITE.to_json(), "manifest_bytes": True}), "manifest_bytes"),
    (_encoded({**INVITE.to_json(), "manifest_bytes": 1 << 40}), "manifest_bytes"),
    (_encoded({**INVITE.to_json(), "seed": "nohost"}), "seed: bad address"),
    (_encoded({**INVITE.to_json(), "model": "a\x1bb"}), "model is not printable"),
    (_encoded({**INVITE.to_json(), "swarm": 7}), "swarm is not a sha256"),
])
def test_a_bad_invite_is_one_line_naming_the_problem(text, cause):
    with pytest.raises(InviteError, match=None) as raised:
        parse_invite(text)
    message = str(raised.value)
    assert cause in message and "\n" not in message, message


STAGES_INVITE = Invite(INVITE.dht, INVITE.model, INVITE.manifest, 1234, INVITE.seed, INVITE.manifest_seed, None, 3)
STAGES_GOLDEN = ("moeswarm-invite-1.eyJkaHQiOlsiL2lwNC8xMjcuMC4wLjEvdGNwLzQwMDEvcDJwLzEyRDNLb29XRXhhbXBsZSJdLCJtYW5pZmVzdC"
                 "I6ImFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWEiLCJtYW5pZmVzdF9i"
                 "eXRlcyI6MTIzNCwibWFuaWZlc3Rfc2VlZCI6IjEyNy4wLjAuMTo3MDAxIiwibW9kZWwiOiJmcDAxMjMiLCJzZWVkIjoiMTI3LjAuMC4x"
                 "OjcwMDAiLCJzdGFnZXMiOjMsInN3YXJtIjpudWxsfQ")


def test_a_stages_invite_is_pinned_and_one_without_the_field_is_an_experts_swarms():
    assert format_invite(STAGES_INVITE) == STAGES_GOLDEN
    assert parse_invite(STAGES_GOLDEN).stages == 3
    assert parse_invite(GOLDEN).stages is None  # written before the field existed: an experts swarm
    assert "stages" not in json.loads(base64.urlsafe_b64decode(GOLDEN[18:] + "==="))


@pytest.mark.parametrize("stages", [0, -1, 257, 2.0, "2", True, [2]])
def test_a_malformed_stages_field_is_one_line(stages):
    with pytest.raises(InviteError) as raised:
        parse_invite(_encoded({**INVITE.to_json(), "stages": stages}))
    assert "stages is not an integer in 1-256" in str(raised.value) and "\n" not in str(raised.value)
