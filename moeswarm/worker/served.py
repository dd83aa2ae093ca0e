"""A worker's measured load: the rows each held expert computed, and their rate over a recent window.

Every way a DISPATCH is answered adds to the same counters (`Served`): the store's `run` (the full
path, float experts' express lanes, merged calls), express's quantized lanes from the C call's
counts, the one-call partial answer from the ids it maps, and the C lanes that answer whole
RESULT frames (on the loop and in a connection hold) through a pointer into the counters
(kernels/qk_express.c `served`). A row is one routed (token, expert) pair.

The rate announced on the DHT (discovery/record.py `load`) is `LoadWindow`'s: rows per minute of
each held expert between the oldest snapshot within `span_s` and now, sampled at each refresh of
the announcement. Placement weights a (layer, expert) pair by the rates its holders announce
(placement/load.py). Counts are int64 and only added to, by one thread at a time (the compute
runner's work); a reader on another thread may see a count a DISPATCH old, which a window forgives.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

MIN_WINDOW_S = 1.0  # a rate over less than this is not announced (the first refresh comes TTL/3 after start)


class Served:
    """Rows computed per (MoE layer, expert) since start.

    held: {layer: experts held}; num_experts: the model's experts per layer. rows[layer] is an
    int64 array [E] (only held experts' entries grow)."""

    def __init__(self, held: Mapping[int, Sequence[int]], num_experts: int):
        self.held = {int(layer): tuple(int(e) for e in experts) for layer, experts in held.items()}
        self.rows = {layer: np.zeros(num_experts, np.int64) for layer in self.held}  # [E] each

    def add(self, layer: int, experts: Sequence[int] | np.ndarray, counts: Sequence[int] | np.ndarray) -> None:
        """Add `counts[i]` rows to expert `experts[i]` of `layer` (experts distinct; an unknown layer is ignored)."""
        rows = self.rows.get(layer)
        if rows is not None and len(experts):
            rows[np.asarray(experts, np.int64)] += np.asarray(counts, np.int64)

    def span(self, layer: int, first: int, count: int) -> np.ndarray | None:
        """The counters of experts first..first+count-1 of `layer` (a view: what is added to it counts),
        contiguous int64 for a C lane; None for a layer not held."""
        rows = self.rows.get(layer)
        return None if rows is None else rows[first : first + count]

    def totals(self) -> dict[int, tuple[int, ...]]:
        """{layer: rows of each held expert, in `held`'s order} so far."""
        return {layer: tuple(int(r) for r in self.rows[layer][list(experts)]) for layer, experts in self.held.items()}


class LoadWindow:
    """Rows per minute of each held expert over the last `span_s` seconds, from snapshots of `Served`."""

    def __init__(self, served: Served, span_s: float, clock: Callable[[], float] = time.monotonic):
        self.served = served
        self.span_s = span_s
        self.clock = clock
        self._snapshots: deque[tuple[float, dict[int, tuple[int, ...]]]] = deque()

    def mark(self) -> None:
        """Take a snapshot now (the window's first one: after the start-up measurement, which is not load)."""
        self._snapshots.append((self.clock(), self.served.totals()))

    def rates(self) -> dict[int, tuple[int, ...]] | None:
        """Take a snapshot, and return {layer: rows per minute of each held expert} since the oldest
        snapshot kept (the newest older than `span_s`, or the first); None while less than
        MIN_WINDOW_S has been seen."""
        now, totals = self.clock(), self.served.totals()
        while len(self._snapshots) > 1 and now - self._snapshots[1][0] >= self.span_s:
            self._snapshots.popleft()
        if not self._snapshots:
            self._snapshots.append((now, totals))
            return None
        then, before = self._snapshots[0]
        self._snapshots.append((now, totals))
        elapsed = now - then
        if elapsed < MIN_WINDOW_S:
            return None
        return {layer: tuple(round((after - old) * 60 / elapsed) for after, old in zip(totals[layer], before[layer]))
                for layer in totals}


def served_span(store, layer: int, first: int, count: int) -> np.ndarray | None:
    """`store`'s counters [count] of experts first.. of `layer` (`Served.span`), or None for a store
    without counters (a stand-in store in tests) or a layer it does not hold."""
    served = getattr(store, "served", None)
    return None if served is None else served.span(layer, first, count)
