"""Several batches in flight: groups of a step take turns on the backbone at every MoE layer.

A step's sequences may run as G groups, each one packed forward in its own thread. Only the group
holding the turn computes; at every MoE layer it sends its rows (the dispatcher's `dispatch`
returns at once) and hands the turn to the next group, which computes its own attention and
routers while the first group's trip is on the wire, sends, and hands the turn on. A group gets
the turn back where it left it: it computes its shared expert and gathers its replies (`combine`).
This is the two-micro-batch overlap of DeepSeek's inference and MegaScale-Infer's ping-pong, with
threads as the coroutines: one thread runs at a time, so the dispatcher and its links are never
used by two at once. With one group there is no turn to hand on.

Round trips stay one per worker per MoE layer per group.
"""

from __future__ import annotations

import threading
import time

import torch

from moeswarm.model.experts_backend import ExpertsBackend


class TakingTurns:
    """Stands between the model's MoE layers and a dispatcher (`Swarm.interpose`)."""

    def __init__(self, inner: ExpertsBackend):
        self.inner = inner
        self._lock = threading.Condition()
        self._order: list[int] = []  # the groups still running, in turn order
        self._turn: int | None = None
        self._group = threading.local()
        self.waiting_s = 0.0  # in `combine`, summed since `begin`: the turn holder waits, nobody computes

    def begin(self, groups: int) -> None:
        """A step starts with `groups` groups; group i calls `enter(i)` in its thread, `leave()` at its end."""
        with self._lock:
            self._order = list(range(groups))
            self._turn = 0 if groups > 1 else None
            self.waiting_s = 0.0

    def enter(self, group: int) -> None:
        """Wait for this group's first turn."""
        self._group.index = group
        with self._lock:
            while self._turn is not None and self._turn != group:
                self._lock.wait()

    def leave(self) -> None:
        """This thread's group has finished its forward (or raised): the others go on without it."""
        group = getattr(self._group, "index", None)
        with self._lock:
            if group in self._order:
                following = self._next(group)
                self._order.remove(group)
                if self._turn == group:
                    self._turn = following if len(self._order) > 1 else None
                elif len(self._order) <= 1:
                    self._turn = None
                self._lock.notify_all()
        self._group.index = None

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """hidden [T, d], top_k_index [T, k] long, top_k_weights [T, k]: sent now; the turn passes on."""
        handle = self.inner.dispatch(layer, hidden, top_k_index, top_k_weights)
        self._pass_turn()
        return handle

    def combine(self, handle) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self.inner.combine(handle)  # [T, d]
        finally:
            self.waiting_s += time.perf_counter() - start

    def _pass_turn(self) -> None:
        group = getattr(self._group, "index", None)
        with self._lock:
            if self._turn is None or group is None:
                return
            self._turn = self._next(group)
            self._lock.notify_all()
            while self._turn is not None and self._turn != group:
                self._lock.wait()

    def _next(self, group: int) -> int:
        at = self._order.index(group)
        return self._order[(at + 1) % len(self._order)]
