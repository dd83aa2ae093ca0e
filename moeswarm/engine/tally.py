"""One request's figures in the engine: what `generate` reports about its run."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeswarm.engine.speculation import SequenceDrafts
from moeswarm.engine.request_metrics import RequestClock


@dataclass
class Tally:
    tokens: list[int] = field(default_factory=list)  # the output so far, end-of-sequence token included
    drafted: int = 0  # draft tokens of the branches kept
    accepted: int = 0
    steps: int = 0  # decode forwards (after the prompt)
    branches: int = 0  # draft rows verified side by side, summed over the steps
    drafted_all: int = 0  # draft tokens verified, over every branch
    seconds: float = 0.0  # in the steps' forwards and the drafting (the --check-local reference's time not counted)
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0
    drafts: SequenceDrafts | None = None  # its speculation: the K chosen, acceptance per position (engine/speculation.py)
    clock: RequestClock | None = None  # the request's moments, for /metrics (set by Engine.submit)
