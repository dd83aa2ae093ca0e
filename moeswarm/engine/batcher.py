"""One dispatch per MoE layer for every sequence of a step: the meeting point of their forwards.

Each sequence of a step runs its own forward, in its own thread, with its own KV cache and length:
attention is computed exactly as if it ran alone (no padding, no shared mask). At every MoE layer
their expert calls meet here. When every forward still running has arrived, the last to arrive
concatenates their rows in slot order, makes ONE dispatch through the inner dispatcher (so a step
sends at most one DISPATCH per worker per MoE layer, whatever the number of sequences), and hands
each call its slice of the output.

A failed layer call fails only the sequences that needed the failed holder: the rows are sent
again one sequence at a time, and each sequence gets its own answer or its own error.

Legend: t_i = tokens of sequence i in the step, T = sum t_i, k = top-k, d = hidden size.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.model.experts_backend import ExpertsBackend


@dataclass(eq=False)
class _Call:
    order: int  # the sequence's slot in the step: the concatenation order, fixed whatever the arrival order
    layer: int
    hidden: torch.Tensor  # [t_i, d]
    top_k_index: torch.Tensor  # [t_i, k] long
    top_k_weights: torch.Tensor  # [t_i, k]
    output: torch.Tensor | None = None  # [t_i, d]
    error: MoeSwarmError | None = None
    done: bool = False


class StepBatcher:
    """Stands between the model's MoE layers and a dispatcher (`Swarm.interpose(StepBatcher)`)."""

    def __init__(self, inner: ExpertsBackend):
        self.inner = inner
        self._lock = threading.Condition()
        self._running = 0  # forwards of this step that have not ended
        self._waiting: list[_Call] = []
        self._slot = threading.local()

    def begin(self, forwards: int) -> None:
        """A step starts with `forwards` forwards; each calls `enter(order)` in its thread and `leave()` at its end."""
        with self._lock:
            if self._running or self._waiting:
                raise RuntimeError("a step began before the previous one ended")
            self._running = forwards

    def enter(self, order: int) -> None:
        self._slot.order = order

    def leave(self) -> None:
        """This thread's forward ended (or raised): the others no longer wait for it."""
        with self._lock:
            self._running -= 1
        self._flush_if_all_here()

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> _Call:
        call = _Call(self._slot.order, layer, hidden, top_k_index, top_k_weights)
        with self._lock:
            self._waiting.append(call)
        self._flush_if_all_here()
        with self._lock:
            while not call.done:
                self._lock.wait()
        return call

    def combine(self, call: _Call) -> torch.Tensor:
        if call.error is not None:
            raise call.error
        return call.output

    def _flush_if_all_here(self) -> None:
        with self._lock:
            if not self._waiting or len(self._waiting) < self._running:
                return
            calls, self._waiting = sorted(self._waiting, key=lambda c: c.order), []
        try:
            self._run(calls)  # outside the lock: every other forward of the step is waiting anyway
        except Exception as error:  # a bug, not a holder's fault: every call of the batch gets it, none hangs
            for call in calls:
                if call.output is None and call.error is None:
                    call.error = MoeSwarmError(f"layer {call.layer} call failed: {one_line(error)}")
        finally:
            with self._lock:
                for call in calls:
                    call.done = True
                self._lock.notify_all()

    def _run(self, calls: list[_Call]) -> None:
        layers = {call.layer for call in calls}
        if len(layers) != 1:  # every forward of a step walks the same layers in the same order
            error = MoeSwarmError(f"a step's forwards met at different MoE layers {sorted(layers)}")
            for call in calls:
                call.error = error
            return
        try:
            outputs = self._dispatch(calls)
        except MoeSwarmError as error:
            if len(calls) == 1:
                calls[0].error = error
                return
            for call in calls:  # again one sequence at a time: only those that need the failed holder fail
                try:
                    call.output = self._dispatch([call])[0]
                except MoeSwarmError as alone:
                    call.error = alone
            return
        for call, output in zip(calls, outputs):
            call.output = output

    def _dispatch(self, calls: list[_Call]) -> list[torch.Tensor]:
        hidden = torch.cat([c.hidden for c in calls])  # [T, d]
        index = torch.cat([c.top_k_index for c in calls])  # [T, k]
        weights = torch.cat([c.top_k_weights for c in calls])  # [T, k]
        out = self.inner.combine(self.inner.dispatch(calls[0].layer, hidden, index, weights))  # [T, d]
        return list(torch.split(out, [c.hidden.shape[0] for c in calls]))
