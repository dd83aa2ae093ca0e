"""What a worker announces on the DHT, and the checks a record passes before a backbone uses it.

A record is plain msgpack data (hivemind stores values with msgpack; nothing is unpickled) under
the key `announcement_key(fingerprint)`, one subkey per worker: its address. Records come from
the network, so `parse_record` bounds every size and checks every type before anything is used;
a record that fails is ignored by the reader (and logged once, escaped).

The record only says where to dial: the experts a backbone places on a worker are the ones the
worker's own HELLO announces over the link, and the HELLO checks the model fingerprint again. A
lying record costs a connection attempt, never a wrong answer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from moeswarm.ids import MAX_EXPERT_ID, format_ids, parse_experts

RECORD_VERSION = 1
KEY_PREFIX = "moeswarm/v1/"

# Bounds on a record read from the network (far above any real model, far below harm).
MAX_ADDRESS = 600  # HOST:PORT, relay://RELAY:PORT/NAME, or both joined by '+'
MAX_NAME = 128  # fingerprint, model type
MAX_LAYERS = 4096
MAX_RUNS_TEXT = 8192  # one layer's experts as "0-3,9,17-20"
MAX_HIDDEN = 1 << 20
MAX_COUNT = 1 << 31  # connections, tokens per DISPATCH
MAX_LOAD_VALUES = 1 << 16  # rates in a record's `load`, over all its layers
MAX_RATE = 1 << 40  # rows per minute of one expert
MAX_FIELDS = 16  # in a seed's, a stage's or a joiner's record
MAX_VERSION = 64  # a worker's or a stage's moeswarm version
MAX_UNIX_S = 1 << 40  # a worker's or a stage's start time


class RecordError(ValueError):
    """A DHT record that is not a valid announcement (its text says what is wrong)."""


@dataclass(frozen=True)
class Capacity:
    """What the worker accepts: open connections and tokens per DISPATCH (worker/limits.py)."""

    connections: int
    tokens_per_dispatch: int


@dataclass(frozen=True)
class Announcement:
    """One worker's record.

    address: how backbones reach it (a `--workers` entry: HOST:PORT, or a relay form, transport/path.py).
    held: {MoE layer: experts held in it, ascending}.
    throughput: tokens per second through every held layer, measured by the worker at start (0: unmeasured).
    online: False in the record a worker leaves when it shuts down cleanly (dropped at once).
    load: {MoE layer: rows per minute each expert of held[layer] computed here, in its order}, over
    the worker's recent window (worker/served.py); None: not measured yet, or a record from a
    moeswarm that announces none (the field is optional: such records read as before).
    version: the moeswarm version the worker runs; started: when it started serving (Unix
    seconds, its own clock); both optional (None: a record from a moeswarm that says neither),
    shown by `status` and the `/swarm` page, never used to route.
    """

    address: str
    fingerprint: str
    model_type: str
    num_experts: int
    hidden_size: int
    held: dict[int, tuple[int, ...]] = field(hash=False)
    tls: bool
    capacity: Capacity
    throughput: float
    online: bool = True
    load: dict[int, tuple[int, ...]] | None = field(default=None, hash=False)
    version: str | None = None
    started: float | None = None

    def to_value(self) -> dict:
        """The msgpack-able value stored on the DHT (experts as runs: "0-63", not 64 integers)."""
        load = {} if self.load is None else {"load": [[layer, list(rates)] for layer, rates in sorted(self.load.items())]}
        return {**load, **about_value(self.version, self.started),
            "v": RECORD_VERSION, "address": self.address, "fingerprint": self.fingerprint,
            "model_type": self.model_type, "num_experts": self.num_experts, "hidden_size": self.hidden_size,
            "held": [[layer, format_ids(experts)] for layer, experts in sorted(self.held.items())],
            "tls": self.tls, "capacity": [self.capacity.connections, self.capacity.tokens_per_dispatch],
            "throughput": float(self.throughput), "online": self.online,
        }

    def offline(self) -> "Announcement":
        return dataclasses.replace(self, online=False)


def announcement_key(fingerprint: str) -> str:
    """The DHT key under which the workers of one model announce themselves."""
    return KEY_PREFIX + fingerprint


@dataclass(frozen=True)
class RecordKind:
    """What is announced under a model's key: workers (this module) or stages (discovery/stage_record.py).

    key: the DHT key of a model's records of this kind, from its fingerprint.
    parse: (subkey, value, fingerprint) -> the record; RecordError when it is not one.
    """

    key: Callable[[str], str]
    parse: Callable[[object, object, str], object]


def entry_head(subkey: object, value: object, fingerprint: str, version: int, max_address: int,
               kind: str = "record") -> tuple[Mapping, str]:
    """(the entry's map, its address) once the fields every record kind shares are checked: a map of
    `version`, an address that is the subkey it was stored under, and this model's fingerprint."""
    if not isinstance(value, Mapping):
        raise RecordError(f"a {type(value).__name__}, not a map")
    if value.get("v") != version:
        raise RecordError(f"{kind} version {quoted(value.get('v'))}, this moeswarm reads {version}")
    address = text_field(value, "address", max_address)
    if subkey != address:
        raise RecordError(f"stored under {quoted(subkey)} but names address {quoted(address)}")
    check_address(address)
    found = text_field(value, "fingerprint", MAX_NAME)
    if found != fingerprint:
        raise RecordError(f"fingerprint {quoted(found)} under the key of {fingerprint}")
    return value, address


def direct_entry_head(subkey: object, value: object, fingerprint: str, version: int, max_address: int, kind: str,
                      fields: int | str) -> tuple[Mapping, str]:
    """`entry_head` for the record of a process dialled directly (a seed, a stage, a joiner's DHT
    node): a map of at most MAX_FIELDS entries (a `kind` has `fields`), its address HOST:PORT."""
    if isinstance(value, Mapping) and len(value) > MAX_FIELDS:
        raise RecordError(f"{len(value)} fields: a {kind} has {fields}")
    value, address = entry_head(subkey, value, fingerprint, version, max_address, kind)
    if "+" in address or "://" in address:
        raise RecordError(f"address {quoted(address)} is not HOST:PORT (a {kind.split()[0]} is dialled directly)")
    return value, address


def span_field(value: Mapping, name: str) -> range:
    """The layers `value[name]` names as [first, last]; RecordError unless 0 <= first <= last < MAX_LAYERS."""
    span = value.get(name)
    if not (isinstance(span, (list, tuple)) and len(span) == 2 and all(type(v) is int for v in span)
            and 0 <= span[0] <= span[1] < MAX_LAYERS):
        raise RecordError(f"{name} {quoted(span)} is not [first, last] with 0 <= first <= last < {MAX_LAYERS}")
    return range(span[0], span[1] + 1)


def parse_record(subkey: object, value: object, fingerprint: str) -> Announcement:
    """The announcement in one DHT entry (subkey: the address it was stored under); RecordError if malformed."""
    value, address = entry_head(subkey, value, fingerprint, RECORD_VERSION, MAX_ADDRESS)
    num_experts = int_field(value, "num_experts", 1, MAX_EXPERT_ID + 1)
    hidden_size = int_field(value, "hidden_size", 1, MAX_HIDDEN)
    capacity = value.get("capacity")
    if not (isinstance(capacity, (list, tuple)) and len(capacity) == 2
            and all(type(c) is int and 0 < c <= MAX_COUNT for c in capacity)):
        raise RecordError("capacity is not [connections, tokens per dispatch] as two positive integers")
    throughput = value.get("throughput")
    if type(throughput) not in (int, float) or not math.isfinite(throughput) or throughput < 0:
        raise RecordError(f"throughput {quoted(throughput)} is not a finite number >= 0")
    tls, online = value.get("tls"), value.get("online")
    if type(tls) is not bool or type(online) is not bool:
        raise RecordError("tls and online must be true or false")
    held = _held(value.get("held"), num_experts)
    version, started = about_fields(value)
    return Announcement(address, fingerprint, text_field(value, "model_type", MAX_NAME), num_experts, hidden_size,
                        held, tls, Capacity(*capacity), float(throughput), online, _load(value.get("load"), held),
                        version, started)


def about_value(version: str | None, started: float | None) -> dict:
    """The optional `version` and `started` of a worker's or a stage's record value, each only when set."""
    return {key: value for key, value in (("version", version), ("started", started)) if value is not None}


def about_fields(value: Mapping) -> tuple[str | None, float | None]:
    """(version, started) of a worker's or a stage's record, each None where the record says nothing;
    RecordError for a version that is not printable text of 1 to MAX_VERSION characters, or a
    `started` that is not a number of Unix seconds in (0, MAX_UNIX_S)."""
    version = None if value.get("version") is None else text_field(value, "version", MAX_VERSION)
    started = value.get("started")
    if started is not None and (type(started) not in (int, float) or not 0 < started < MAX_UNIX_S):
        raise RecordError(f"started {quoted(started)} is not a time in Unix seconds")
    return version, None if started is None else float(started)


WORKERS = RecordKind(announcement_key, parse_record)


def _held(raw: object, num_experts: int) -> dict[int, tuple[int, ...]]:
    if not isinstance(raw, (list, tuple)) or not 0 < len(raw) <= MAX_LAYERS:
        raise RecordError(f"held is not a list of 1 to {MAX_LAYERS} [layer, experts] pairs")
    held: dict[int, tuple[int, ...]] = {}
    for pair in raw:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and type(pair[0]) is int
                and 0 <= pair[0] < 1 << 20 and isinstance(pair[1], str) and len(pair[1]) <= MAX_RUNS_TEXT):
            raise RecordError("held has an entry that is not [layer, \"experts\"]")
        layer, text = pair
        if layer in held:
            raise RecordError(f"held names layer {layer} twice")
        try:
            experts = parse_experts(text)
        except ValueError as error:
            raise RecordError(f"layer {layer}: {error}") from None
        if not experts or experts[-1] >= num_experts:
            raise RecordError(f"layer {layer} holds experts outside 0-{num_experts - 1}, or none")
        held[layer] = tuple(experts)
    return held


def _load(raw: object, held: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]] | None:
    """The optional `load`: [[layer, [rows per minute of each expert held there]]], for held layers only."""
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or len(raw) > len(held):
        raise RecordError("load is not a list of [layer, rates] pairs, at most one per held layer")
    load: dict[int, tuple[int, ...]] = {}
    total = 0
    for pair in raw:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and type(pair[0]) is int
                and isinstance(pair[1], (list, tuple))):
            raise RecordError("load has an entry that is not [layer, [rates]]")
        layer, rates = pair
        if layer not in held or layer in load:
            raise RecordError(f"load names layer {quoted(layer)}, which is not a held layer or is named twice")
        total += len(rates)
        if len(rates) != len(held[layer]) or total > MAX_LOAD_VALUES:
            raise RecordError(f"load of layer {layer} has {len(rates)} rates for {len(held[layer])} held experts "
                              f"(at most {MAX_LOAD_VALUES} in all)")
        if not all(type(rate) is int and 0 <= rate <= MAX_RATE for rate in rates):
            raise RecordError(f"load of layer {layer} has a rate that is not an integer in 0-{MAX_RATE}")
        load[layer] = tuple(rates)
    return load


def check_address(address: str) -> None:
    from moeswarm.transport.path import canonical_address  # the path policy owns the address forms

    try:
        canonical = canonical_address(address)
    except ValueError as error:
        raise RecordError(str(error)) from None
    if canonical != address:  # respellings of one worker (127.1:07730) would each pass for another
        raise RecordError(f"address {quoted(address)} is not in canonical form ({quoted(canonical)})")


def text_field(value: Mapping, name: str, limit: int) -> str:
    text = value.get(name)
    if not isinstance(text, str) or not 0 < len(text) <= limit or not text.isprintable():
        raise RecordError(f"{name} is not printable text of 1 to {limit} characters")
    return text


def int_field(value: Mapping, name: str, low: int, high: int) -> int:
    number = value.get(name)
    if type(number) is not int or not low <= number <= high:
        raise RecordError(f"{name} {quoted(number)} is not an integer in {low}-{high}")
    return number


def quoted(value: object) -> str:
    """A peer's value quoted in a message: bounded (the message is escaped where it is printed)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
