"""Calls other threads hand the engine's thread, run between two steps (`Engine.run_between_steps`):
work that needs the model and the swarm free, such as a forward outside the batch (/v1/embeddings)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from moeswarm.errors import MoeSwarmError


class BetweenSteps:
    """The calls waiting for the engine's thread, in the order they came."""

    def __init__(self, wake: threading.Condition):
        """wake: the engine's condition, notified when a call comes (the engine thread may be waiting on it)."""
        self._wake = wake
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: Callable[[], object]) -> Future:
        """`call` queued from any thread; its result or exception in the future."""
        future: Future = Future()
        with self._wake:
            self._calls.append((call, future))
            self._wake.notify_all()
        return future

    def run(self) -> None:
        """Run every queued call (the engine's thread, between steps); a cancelled one is skipped, and a
        call's exception goes to its future (the caller's to report: the engine goes on)."""
        while self._calls:
            with self._wake:
                call, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # the caller's to report: the engine goes on
                future.set_exception(error)

    def refuse(self, message: str) -> None:
        """Every queued call's future fails with `message` (the engine stops)."""
        while self._calls:
            self._calls.popleft()[1].set_exception(MoeSwarmError(message))
