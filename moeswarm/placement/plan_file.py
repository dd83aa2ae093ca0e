"""A placement plan as data: which worker holds which experts of each MoE layer, and its file.

`moeswarm plan` writes one (placement/planner.py computes it); `moeswarm worker --plan PLAN.json
--plan-worker NAME` serves one worker's part, as does `--experts` in the per-layer form this
module parses ("0:1-4,9;1:2-5": layer, colon, experts; layers separated by semicolons).
Nothing here imports torch: the worker's flags parse fast.

Plan file (JSON):
  {"format": "moeswarm-placement-plan", "version": 1, "num_experts": E, "replicas": R,
   "workers": [{"name": str, "capacity": experts per layer, "rtt_ms": float,
                "experts": {"layer": [ascending expert ids]}}, ...],
   "estimate": {...}}   (optional, what the planner's simulation expects; not read back)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import MAX_EXPERT_ID, format_ids, parse_experts

PLAN_FORMAT = "moeswarm-placement-plan"
PLAN_VERSION = 1
MAX_PLAN_BYTES = 64 << 20  # 1,000 workers x 100 layers x 256 experts stays far below
MAX_WORKERS = 4096
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

LayerExperts = dict[int, tuple[int, ...]]  # {MoE layer: ascending distinct expert ids}


@dataclass(frozen=True)
class WorkerSpec:
    """What the planner knows of a worker: a name, room for `capacity` experts per layer, its RTT."""

    name: str
    capacity: int
    rtt_ms: float


@dataclass(frozen=True)
class PlannedWorker:
    spec: WorkerSpec
    experts: LayerExperts  # {layer: the experts it holds there}; a layer may be absent (none held)


@dataclass(frozen=True)
class Plan:
    num_experts: int
    replicas: int  # extra copies per layer beyond one of each expert (the replica budget)
    workers: tuple[PlannedWorker, ...]

    @property
    def layers(self) -> list[int]:
        return sorted({layer for w in self.workers for layer in w.experts})

    def worker(self, name: str) -> PlannedWorker:
        for planned in self.workers:
            if planned.spec.name == name:
                return planned
        raise MoeSwarmError(f"the plan has no worker {name!r} (its workers: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [w.spec.name for w in self.workers]

    def held(self) -> dict[int, LayerExperts]:
        """{worker index: {layer: experts}}: the announcements placement/table.py builds a table from."""
        return {i: dict(w.experts) for i, w in enumerate(self.workers)}

    def to_json(self, estimate: Mapping | None = None) -> dict:
        out = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "num_experts": self.num_experts, "replicas": self.replicas,
               "workers": [{"name": w.spec.name, "capacity": w.spec.capacity, "rtt_ms": w.spec.rtt_ms,
                            "experts": {str(layer): list(ids) for layer, ids in sorted(w.experts.items())}}
                           for w in self.workers]}
        return {**out, "estimate": dict(estimate)} if estimate is not None else out

    @classmethod
    def from_json(cls, data: object, where: str = "plan") -> "Plan":
        """Check and read a plan; MoeSwarmError naming `where` and the bad field."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise MoeSwarmError(f"{where}: not a placement plan (no \"format\": \"{PLAN_FORMAT}\")")
        if data.get("version") != PLAN_VERSION:
            raise MoeSwarmError(f"{where}: plan version {data.get('version')!r} (this moeswarm reads {PLAN_VERSION})")
        e, replicas, workers = data.get("num_experts"), data.get("replicas"), data.get("workers")
        if not _count(e) or not 1 <= e <= MAX_EXPERT_ID + 1:
            raise MoeSwarmError(f"{where}: bad num_experts {e!r}")
        if not _count(replicas):
            raise MoeSwarmError(f"{where}: bad replicas {replicas!r}: expected a non-negative integer")
        if not isinstance(workers, list) or not 1 <= len(workers) <= MAX_WORKERS:
            raise MoeSwarmError(f"{where}: \"workers\" must be a list of 1 to {MAX_WORKERS} workers")
        planned = tuple(_worker(w, e, f"{where}: worker {i}") for i, w in enumerate(workers))
        names = [w.spec.name for w in planned]
        if len(set(names)) != len(names):
            raise MoeSwarmError(f"{where}: worker names must be distinct, got {', '.join(names)}")
        return cls(e, replicas, planned)


def _worker(data: object, num_experts: int, where: str) -> PlannedWorker:
    if not isinstance(data, dict):
        raise MoeSwarmError(f"{where}: expected an object with name, capacity, rtt_ms and experts")
    name, capacity, rtt_ms, experts = (data.get(k) for k in ("name", "capacity", "rtt_ms", "experts"))
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise MoeSwarmError(f"{where}: bad name {str(name)[:80]!r}: 1 to 64 of A-Z a-z 0-9 . _ -")
    if not _count(capacity):
        raise MoeSwarmError(f"{where} ({name}): bad capacity {capacity!r}")
    if not isinstance(rtt_ms, (int, float)) or isinstance(rtt_ms, bool) or not math.isfinite(rtt_ms) or rtt_ms < 0:
        raise MoeSwarmError(f"{where} ({name}): bad rtt_ms {rtt_ms!r}")
    if not isinstance(experts, dict):
        raise MoeSwarmError(f"{where} ({name}): \"experts\" must be an object {{\"layer\": [experts]}}")
    held: LayerExperts = {}
    for key, ids in experts.items():
        if not key.isdigit() or int(key) > 1 << 20:
            raise MoeSwarmError(f"{where} ({name}): bad layer {key[:20]!r}")
        if (not isinstance(ids, list) or not all(_count(i) and i < num_experts for i in ids)
                or ids != sorted(set(ids)) or len(ids) > capacity):
            raise MoeSwarmError(f"{where} ({name}): layer {key} must list at most {capacity} (its capacity) distinct "
                                f"ascending expert ids below {num_experts}")
        if ids:
            held[int(key)] = tuple(ids)
    return PlannedWorker(WorkerSpec(name, capacity, float(rtt_ms)), held)


def read_plan(path: str | Path) -> Plan:
    """A plan file written by `moeswarm plan`; MoeSwarmError naming the file when it is not one."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_PLAN_BYTES:
            raise MoeSwarmError(f"{path}: {path.stat().st_size} bytes, more than a plan's {MAX_PLAN_BYTES}")
        data = json.loads(path.read_text())
    except OSError as error:
        raise MoeSwarmError(f"cannot read plan {path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MoeSwarmError(f"{path}: not JSON ({' '.join(str(error).split())})") from None
    return Plan.from_json(data, str(path))


def parse_worker_spec(text: str) -> WorkerSpec:
    """"NAME:CAPACITY:RTT_MS" -> WorkerSpec; ValueError naming the bad part."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"bad worker {text!r}: expected NAME:CAPACITY:RTT_MS, e.g. w0:10:20")
    name, capacity, rtt = parts
    if not NAME.fullmatch(name):
        raise ValueError(f"bad worker name {name!r} in {text!r}: 1 to 64 of A-Z a-z 0-9 . _ -")
    if not capacity.isdigit() or int(capacity) > MAX_EXPERT_ID + 1:
        raise ValueError(f"bad capacity {capacity!r} in {text!r}: experts per layer, a whole number")
    try:
        rtt_ms = float(rtt)
    except ValueError:
        rtt_ms = -1.0
    if not math.isfinite(rtt_ms) or rtt_ms < 0:
        raise ValueError(f"bad RTT {rtt!r} in {text!r}: milliseconds, a number >= 0")
    return WorkerSpec(name, int(capacity), rtt_ms)


def parse_layer_experts(text: str) -> LayerExperts:
    """"0:1-4,9;1:2-5" -> {0: (1, 2, 3, 4, 9), 1: (2, 3, 4, 5)}; ValueError naming the bad part."""
    held: LayerExperts = {}
    for part in (p.strip() for p in text.split(";")):
        layer, sep, ids = part.partition(":")
        if not sep or not layer.strip().isdigit():
            raise ValueError(f"bad per-layer expert list {text!r}: {part!r} is not LAYER:EXPERTS (e.g. 0:1-4,9;1:2-5)")
        number = int(layer)
        if number in held:
            raise ValueError(f"bad per-layer expert list {text!r}: layer {number} appears twice")
        held[number] = tuple(parse_experts(ids))
    return held


def format_layer_experts(held: Mapping[int, Sequence[int]]) -> str:
    """parse_layer_experts' inverse: {0: [1, 2, 3, 4, 9], 1: [2, 3, 4, 5]} -> "0:1-4,9;1:2-5"."""
    return ";".join(f"{layer}:{format_ids(list(ids))}" for layer, ids in sorted(held.items()) if ids)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
