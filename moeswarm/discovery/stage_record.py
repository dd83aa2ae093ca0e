"""What a stage announces on the DHT (`moeswarm stage --announce-swarm`), and its checks on reading.

A stage record says where a span of a model's decoder layers is served: under the key
`stage_key(fingerprint)`, one subkey per stage (its address, or `MEMBER_ID@ADDRESS` signed in a
keyed swarm: discovery/sign.py), a small msgpack map:

    {"v": 1, "address": "HOST:PORT", "fingerprint": ..., "model_type": ..., "layers": [first, last],
     "hidden_size": d, "tls": bool, "online": bool, "version": "0.1.0", "started": 1800000000.0}

`version` (the moeswarm the stage runs) and `started` (when it started serving its span, Unix
seconds by its own clock) are optional, as in a worker's record (discovery/record.py): a record
from a moeswarm that says neither reads as before.

Records come from the network: `parse_stage_record` bounds every size and checks every type. A
record only says where to dial: the gateway's HELLO to the stage names the layers it really
holds, and a HELLO that contradicts the record drops it (stages/find.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeswarm.discovery.record import (
    KEY_PREFIX, MAX_HIDDEN, MAX_NAME, RecordError, RecordKind, about_fields, about_value, direct_entry_head, int_field,
    span_field, text_field,
)

STAGE_RECORD_VERSION = 1
STAGE_KEY_PREFIX = KEY_PREFIX + "stages/"
MAX_STAGE_ADDRESS = 300  # HOST:PORT (a stage is dialled directly: no relay form)


@dataclass(frozen=True)
class StageRecord:
    """One stage's record.

    address: HOST:PORT that gateways dial (canonical: transport/path.py).
    layers: the decoder layers it holds, a contiguous span (range, stop exclusive).
    tls: whether it requires the swarm key; a gateway uses only stages that match its own.
    online: False in the record a stage leaves when it stops cleanly.
    version: the moeswarm version the stage runs; started: when it started serving this span (Unix
    seconds, its own clock); both optional (None: a record from a moeswarm that says neither),
    shown by `status` and the `/swarm` page, never used to route.
    """

    address: str
    fingerprint: str
    model_type: str
    layers: range
    hidden_size: int
    tls: bool
    online: bool = True
    version: str | None = None
    started: float | None = None

    def to_value(self) -> dict:
        """The msgpack-able value stored on the DHT (`version` and `started` only when set)."""
        return {**about_value(self.version, self.started), "v": STAGE_RECORD_VERSION, "address": self.address, "fingerprint": self.fingerprint,
                "model_type": self.model_type, "layers": [self.layers.start, self.layers.stop - 1],
                "hidden_size": self.hidden_size, "tls": self.tls, "online": self.online}

    def offline(self) -> "StageRecord":
        return dataclasses.replace(self, online=False)


def stage_key(fingerprint: str) -> str:
    """The DHT key under which the stages of one model announce themselves."""
    return STAGE_KEY_PREFIX + fingerprint


def parse_stage_record(subkey: object, value: object, fingerprint: str) -> StageRecord:
    """The stage record in one DHT entry (subkey: the address it was stored under); RecordError if malformed."""
    value, address = direct_entry_head(subkey, value, fingerprint, STAGE_RECORD_VERSION, MAX_STAGE_ADDRESS,
                                       "stage record", "8 (10 with version and started)")
    layers = span_field(value, "layers")
    tls, online = value.get("tls"), value.get("online")
    if type(tls) is not bool or type(online) is not bool:
        raise RecordError("tls and online must be true or false")
    version, started = about_fields(value)
    return StageRecord(address, fingerprint, text_field(value, "model_type", MAX_NAME), layers,
                       int_field(value, "hidden_size", 1, MAX_HIDDEN), tls, online, version, started)


STAGES = RecordKind(stage_key, parse_stage_record)
