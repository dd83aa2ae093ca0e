"""What the dashboard shows of the engine: recent steps, expert use per layer, per-worker round trips.

Written by the engine thread after each step, read by the HTTP side: a lock guards the windows.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

WINDOW_S = 10.0
RTT_SAMPLES = 512


@dataclass(frozen=True)
class StepRecord:
    at: float  # time.monotonic() at the step's end
    batch: int  # sequences in the step
    fed: int  # tokens fed
    generated: int  # tokens emitted
    drafted: int
    accepted: int


class EngineStats:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._lock = threading.Lock()
        self._steps: deque[StepRecord] = deque()
        self._rtt: dict[str, deque[float]] = {}
        self._calls: dict[str, int] = {}
        self.totals = {"steps": 0, "generated": 0, "fed": 0, "drafted": 0, "accepted": 0}

    def record_step(self, step: StepRecord, worker_seconds: list[dict[str, float]]) -> None:
        with self._lock:
            self._steps.append(step)
            while self._steps and self._steps[0].at < step.at - WINDOW_S:
                self._steps.popleft()
            for key, value in (("steps", 1), ("generated", step.generated), ("fed", step.fed),
                               ("drafted", step.drafted), ("accepted", step.accepted)):
                self.totals[key] += value
            for call in worker_seconds:
                for worker, seconds in call.items():
                    self._rtt.setdefault(worker, deque(maxlen=RTT_SAMPLES)).append(seconds)
                    self._calls[worker] = self._calls.get(worker, 0) + 1

    def recent(self) -> dict:
        """Rates over the last WINDOW_S seconds."""
        now = time.monotonic()
        with self._lock:
            steps = [s for s in self._steps if s.at >= now - WINDOW_S]
        span = WINDOW_S if steps else 1.0
        count = len(steps) or 1
        drafted = sum(s.drafted for s in steps)
        return {
            "tokens_per_s": sum(s.generated for s in steps) / span,
            "steps_per_s": len(steps) / span,
            "tokens_per_step": sum(s.fed for s in steps) / count,
            "batch_size": sum(s.batch for s in steps) / count,
            "accepted_per_drafted": sum(s.accepted for s in steps) / drafted if drafted else None,
        }

    def workers(self) -> dict[str, dict]:
        with self._lock:
            samples = {w: sorted(v) for w, v in self._rtt.items()}
            calls = dict(self._calls)
        return {w: {"calls": calls[w], "rtt_ms_p50": 1000 * _quantile(v, 0.5), "rtt_ms_p99": 1000 * _quantile(v, 0.99)}
                for w, v in samples.items()}

    def heat(self, layers: list[int], counts: dict[int, torch.Tensor]) -> list[list[int]]:
        """Per layer, how often each expert was chosen; counts: {layer: [E] int64} (the swarm's routing
        statistics, counted as its dispatcher routes: the engine does not count them again)."""
        return [counts[layer].tolist() if layer in counts else [0] * self.num_experts for layer in layers]


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
