"""What a seed announces on the DHT (a joined member serving the pieces it fetched), and its checks.

A member that fetched a slice keeps the pieces (slices/fetch.py `keep_pieces`) and serves them
with the inviter's seeder protocol (slices/seed.py, limited to those pieces). It says so under the
key `seed_key(fingerprint)`, one subkey per seed (its address, or `MEMBER_ID@ADDRESS` signed in a
keyed swarm: discovery/sign.py), a small msgpack map:

    {"v": 1, "address": "HOST:PORT", "fingerprint": ..., "manifest": sha256 hex,
     "experts": "0-3,9", "tls": bool, "online": bool}

`experts` names the pieces it holds: those of a slice of these experts under the manifest
(slices/manifest.py `pieces`: the header, the fingerprint's samples and the experts' blocks).
A stages swarm's member (its slice: every expert of its span's MoE layers, and the model's whole
trunk) adds two fields, `"layers": [first, last]` (the MoE layers whose experts' blocks it holds;
absent: every MoE layer) and `"trunk": true` (it holds every non-expert tensor too; absent: false),
so an experts member's record keeps its bytes.
Records come from the network: `parse_seed_record` bounds every size and checks every type. A
record only says where to ask: every piece fetched is checked against the manifest's hash, so a
lying seed costs a connection and is then passed over (slices/fetch.py).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from moeswarm.discovery.record import (
    KEY_PREFIX, MAX_RUNS_TEXT, RecordError, RecordKind, direct_entry_head, quoted, span_field, text_field,
)
from moeswarm.ids import MAX_EXPERT_ID, format_ids, parse_experts

SEED_RECORD_VERSION = 1
SEED_KEY_PREFIX = KEY_PREFIX + "seeds/"
MAX_SEED_ADDRESS = 300  # HOST:PORT (a seed is dialled directly)
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SeedRecord:
    """One seed's record.

    address: HOST:PORT that fetchers dial (canonical: transport/path.py).
    manifest: the sha256 of the manifest its pieces are of (an invite's `manifest`).
    experts: it holds every piece of a slice of these experts (ascending).
    tls: whether it requires the swarm key.
    online: False in the record a seed leaves when it stops cleanly.
    layers: (first, last) MoE layers of the experts' blocks it holds; None: every MoE layer.
    trunk: whether it holds every non-expert tensor too (a stage member's slice).
    """

    address: str
    fingerprint: str
    manifest: str
    experts: tuple[int, ...]
    tls: bool
    online: bool = True
    layers: tuple[int, int] | None = None
    trunk: bool = False

    def to_value(self) -> dict:
        """The msgpack-able value stored on the DHT."""
        value = {"v": SEED_RECORD_VERSION, "address": self.address, "fingerprint": self.fingerprint,
                 "manifest": self.manifest, "experts": format_ids(self.experts), "tls": self.tls, "online": self.online}
        if self.layers is not None:
            value["layers"] = list(self.layers)
        if self.trunk:
            value["trunk"] = True
        return value

    def offline(self) -> "SeedRecord":
        return dataclasses.replace(self, online=False)


def seed_key(fingerprint: str) -> str:
    """The DHT key under which the seeds of one model announce themselves."""
    return SEED_KEY_PREFIX + fingerprint


def parse_seed_record(subkey: object, value: object, fingerprint: str) -> SeedRecord:
    """The seed record in one DHT entry (subkey: the address it was stored under); RecordError if malformed."""
    value, address = direct_entry_head(subkey, value, fingerprint, SEED_RECORD_VERSION, MAX_SEED_ADDRESS,
                                       "seed record", "7 (9 a stage member's)")
    manifest = value.get("manifest")
    if not isinstance(manifest, str) or not _SHA256.fullmatch(manifest):
        raise RecordError(f"manifest {quoted(manifest)} is not a sha256 in lowercase hex")
    text = text_field(value, "experts", MAX_RUNS_TEXT)
    try:
        experts = tuple(parse_experts(text))
    except ValueError as error:
        raise RecordError(f"experts: {error}") from None
    if not experts or experts[-1] > MAX_EXPERT_ID:
        raise RecordError(f"experts {quoted(text)} is empty or beyond expert {MAX_EXPERT_ID}")
    tls, online = value.get("tls"), value.get("online")
    if type(tls) is not bool or type(online) is not bool:
        raise RecordError("tls and online must be true or false")
    layers = None if value.get("layers") is None else span_field(value, "layers")
    trunk = value.get("trunk", False)
    if type(trunk) is not bool:
        raise RecordError("trunk must be true or false")
    return SeedRecord(address, fingerprint, manifest, experts, tls, online,
                      None if layers is None else (layers.start, layers.stop - 1), trunk)


SEEDS = RecordKind(seed_key, parse_seed_record)
