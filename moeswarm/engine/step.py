"""A step as the engine runs it: schedule, run, postprocess, and what watches them.

`Step` is the schedule's answer: the scheduler's `StepPlan` (plain numbers, engine/scheduler.py)
bound to the sequences of its working slots, each with the tokens it feeds. `Ran` is what running
it gave, `Taken` what the sequences took from their logits. A `StepObserver` is told of each at
its phase's end (engine/observers.py: the requests' figures, the policies' measurements, the
metrics, engine/rollback.py's checkpoints, the --check-local reference); observers watch the step,
they never change what it computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeswarm.engine.scheduler import StepPlan
from moeswarm.engine.sequence import Sequence
from moeswarm.engine.tally import Tally

Feed = list[int] | list[list[int]]  # a prompt chunk, the last token and its drafts, or B rows of those


@dataclass(frozen=True)
class Work:
    """One working slot of a step: its sequence and what it feeds."""

    sequence: Sequence
    tally: Tally  # its request's figures
    feed: Feed
    keep: str  # which of its logits come back: "all", or "last" (a prompt chunk's last row)
    decoding: bool  # it feeds its last token (and drafts), not a prompt chunk

    @property
    def rows(self) -> int:
        """Rows fed: its branches (B for B rows), 1 for a single feed."""
        return len(self.feed) if _is_rows(self.feed) else 1

    @property
    def tokens(self) -> int:
        """Tokens fed, every row's, padding included."""
        return sum(len(row) for row in self.feed) if _is_rows(self.feed) else len(self.feed)


@dataclass(frozen=True)
class Step:
    plan: StepPlan
    work: tuple[Work, ...]  # the plan's working slots, in its order
    drafting: tuple[tuple[Tally, float], ...]  # every active sequence's request, and the seconds its drafts took
    started: float  # time.monotonic() when the step began
    decoding: bool  # every working sequence had taken a token before: a decode step (what teaches the policies)
    drafted: bool  # some working sequence feeds drafts

    @property
    def groups(self) -> list[list[int]]:
        """The plan's forwards as indices into `work` (what the runners take)."""
        position = {slot: i for i, slot in enumerate(self.plan.working)}
        return [[position[slot] for slot in group] for group in self.plan.groups]

    @property
    def drafting_s(self) -> float:
        return sum(seconds for _, seconds in self.drafting)


@dataclass(frozen=True)
class Ran:
    outputs: list  # per work item: its logits ([n, V], [1, V] for keep "last", [B, n, V] for B rows) or its error
    seconds: float  # the forwards' wall time
    waiting_s: float  # of which waiting on replies, nobody computing (runner.waiting_s)


@dataclass(frozen=True)
class Took:
    """What one sequence took from its logits."""

    work: Work
    generated: int  # tokens taken
    drafted: int  # draft tokens of the branch kept
    accepted: int  # of which accepted
    at: float  # time.monotonic() when it took them
    first_token: bool  # the first token of its request


@dataclass(frozen=True)
class Taken:
    took: tuple[Took, ...]  # the sequences that took their logits (those whose forward or bookkeeping failed: not)
    failed_worker: bool  # some forward failed on a holder (MoeSwarmError): the health check is due

    @property
    def generated(self) -> int:
        return sum(took.generated for took in self.took)

    @property
    def drafted(self) -> int:
        return sum(took.drafted for took in self.took)

    @property
    def accepted(self) -> int:
        return sum(took.accepted for took in self.took)


class StepObserver:
    """Told of every step at its phases' ends, in the engine's thread; each hook does nothing unless overridden."""

    def before_step(self, step: Step) -> None:
        """Scheduled; nothing has run."""

    def after_run(self, step: Step, ran: Ran) -> None:
        """The forwards ran; no sequence has taken its logits yet (their caches are as the forwards left them)."""

    def after_step(self, step: Step, ran: Ran, taken: Taken) -> None:
        """The sequences took their logits; the finished ones are still in the batch."""


def _is_rows(feed: Feed) -> bool:
    return bool(feed) and isinstance(feed[0], list)
