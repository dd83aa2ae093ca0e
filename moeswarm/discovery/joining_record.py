"""What a joiner announces between choosing its share and serving it (Petals' JOINING state).

A join takes seconds to minutes between reading the coverage and announcing its worker (fetching
the share's bytes, loading them): joiners started meanwhile would read the same coverage and choose
the same weakest share, leaving others uncovered until rebalancing repairs it. So a joiner stores
its choice at once, under `joining_key(fingerprint)`, one subkey per joiner (the HOST:PORT of its
DHT node, or `MEMBER_ID@ADDRESS` signed in a keyed swarm: discovery/sign.py), a small msgpack map:

    {"v": 1, "address": "HOST:PORT", "fingerprint": ..., "experts": "0-3,9" | null,
     "layers": [first, last] | null, "online": bool}

`experts` (an experts swarm: those experts of every MoE layer) or `layers` (a stages swarm: that
span), exactly one. The joiner withdraws it once its worker is announced (or lets it expire, when
it dies meanwhile). Later joiners count it as a holder when they choose (discovery/joining.py);
backbones never read it: a joining record routes nothing, so a lying one can skew a share, never
an answer. Records come from the network: `parse_joining_record` bounds and checks every field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeswarm.discovery.record import (
    KEY_PREFIX, MAX_RUNS_TEXT, RecordError, RecordKind, direct_entry_head, quoted, span_field, text_field,
)
from moeswarm.ids import MAX_EXPERT_ID, format_ids, parse_experts

JOINING_RECORD_VERSION = 1
JOINING_KEY_PREFIX = KEY_PREFIX + "joining/"
MAX_JOINING_ADDRESS = 300  # HOST:PORT of the joiner's DHT node


@dataclass(frozen=True)
class JoiningRecord:
    """One joiner's choice: `experts` (of every MoE layer) or `layers` (a stages swarm's span), the other None."""

    address: str
    fingerprint: str
    experts: tuple[int, ...] | None = None
    layers: range | None = None
    online: bool = True

    def to_value(self) -> dict:
        """The msgpack-able value stored on the DHT."""
        return {"v": JOINING_RECORD_VERSION, "address": self.address, "fingerprint": self.fingerprint,
                "experts": None if self.experts is None else format_ids(self.experts),
                "layers": None if self.layers is None else [self.layers.start, self.layers.stop - 1],
                "online": self.online}

    def offline(self) -> "JoiningRecord":
        return dataclasses.replace(self, online=False)


def joining_text(record: JoiningRecord) -> str:
    """What a joiner chose, in a phrase: "experts 0-3,9" or "layers 3-5"."""
    if record.experts is not None:
        return f"experts {format_ids(record.experts)}"
    return f"layers {record.layers.start}-{record.layers.stop - 1}"


def joining_key(fingerprint: str) -> str:
    """The DHT key under which the joiners of one model say what they are about to serve."""
    return JOINING_KEY_PREFIX + fingerprint


def parse_joining_record(subkey: object, value: object, fingerprint: str) -> JoiningRecord:
    """The joining record in one DHT entry (subkey: the address it was stored under); RecordError if malformed."""
    value, address = direct_entry_head(subkey, value, fingerprint, JOINING_RECORD_VERSION, MAX_JOINING_ADDRESS,
                                       "joining record", 6)
    experts = layers = None
    if value.get("experts") is not None:
        text = text_field(value, "experts", MAX_RUNS_TEXT)
        try:
            experts = tuple(parse_experts(text))
        except ValueError as error:
            raise RecordError(f"experts: {error}") from None
        if not experts or experts[-1] > MAX_EXPERT_ID:
            raise RecordError(f"experts {quoted(text)} is empty or beyond expert {MAX_EXPERT_ID}")
    if value.get("layers") is not None:
        layers = span_field(value, "layers")
    if (experts is None) == (layers is None):
        raise RecordError("a joining record names experts or layers, exactly one")
    online = value.get("online")
    if type(online) is not bool:
        raise RecordError("online must be true or false")
    return JoiningRecord(address, fingerprint, experts, layers, online)


JOINING = RecordKind(joining_key, parse_joining_record)
