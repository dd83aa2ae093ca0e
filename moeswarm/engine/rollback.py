"""Undoing a liar's steps: what each running sequence was before each of its steps.

Layer calls are numbered (dispatch/taint.py). Before every step the engine records, per sequence,
a checkpoint and the range of layer calls the step makes; when a holder is banned, every sequence
whose steps used its unchecked answers goes back to its checkpoint before the first such step
(`Sequence.restore`: caches cropped, tokens and random state as they were, the caller told to take
the text back) and the next steps compute them again. A sequence that cannot rewind (a grammar's
state) is failed instead.

It watches the engine's steps (a StepObserver, engine/step.py): the checkpoints before the forwards,
the layer calls' range after them, and after the step the swarm's taints, handed to `undo`.
"""

from __future__ import annotations

from collections.abc import Callable

from moeswarm.engine.sequence import Checkpoint, Sequence
from moeswarm.engine.step import Ran, Step, StepObserver, Taken


class Rollback(StepObserver):
    def __init__(self, swarm, undo: Callable[[list], None]):
        """undo: told the taints of the holders banned during a step, after it (it calls `apply`)."""
        self.swarm, self.undo = swarm, undo
        self._points: dict[int, list[tuple[int, int, Checkpoint]]] = {}  # id(sequence) -> (first call, last call, before)
        self._step: tuple[list[tuple[Sequence, Checkpoint]], int] = ([], 0)  # this step's checkpoints and first call

    def before_step(self, step: Step) -> None:
        remote = self.swarm.remote  # only remote holders are banned
        points = [(work.sequence, work.sequence.checkpoint()) for work in step.work] if remote else []
        self._step = (points, self.swarm.layer_call_number() + 1)

    def after_run(self, step: Step, ran: Ran) -> None:
        points, first_call = self._step
        self.record(points, first_call, self.swarm.layer_call_number())
        self._step = ([], 0)

    def after_step(self, step: Step, ran: Ran, taken: Taken) -> None:
        taints = self.swarm.take_taints()
        if taints:
            self.undo(taints)

    def record(self, points: list[tuple[Sequence, Checkpoint]], first_call: int, last_call: int) -> None:
        for sequence, point in points:
            self._points.setdefault(id(sequence), []).append((first_call, last_call, point))

    def forget(self, sequence: Sequence) -> None:
        self._points.pop(id(sequence), None)

    def apply(self, active: list[Sequence], taints: list) -> list[tuple[Sequence, Exception | None]]:
        """Restore every sequence a taint hits; (sequence, None) when rolled back, (sequence, error)
        when it could not be (the caller fails it)."""
        done = []
        for sequence in list(active):
            points = self._points.get(id(sequence), [])
            hit = next((i for i, (low, high, _) in enumerate(points) if any(t.hits(low, high) for t in taints)), None)
            if hit is None:
                continue
            point = points[hit][2]
            del points[hit:]
            try:
                sequence.restore(point)
                done.append((sequence, None))
            except ValueError as error:
                done.append((sequence, error))
        return done
