"""The pieces of a layer call in flight: parts of the step's rows, and attempts to get them answered.

A `Part` is rows of the step for one holder (a share of the plan, a piece of one after a failover,
or a piece of one cut to the holder's reply bound); an `Attempt` is a part sent to one holder.
A part serves the call (SERVE) or recomputes a served part's rows to check it (CHECK).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeswarm.dispatch.plan import WorkerShare
from moeswarm.transport.link import Pending, Reply
from moeswarm.wire.messages import Dispatch

SERVE, CHECK = "serve", "check"
REFEREE = -1  # the winner of a part the backbone computed itself (the dispatcher's `referee`)


@dataclass(eq=False)
class Part:
    share: WorkerShare
    request: Dispatch
    role: str = SERVE
    checks: "Part | None" = None  # role CHECK: the served part whose answer this recomputes
    tried: set[int] = field(default_factory=set)  # holders sent this part
    reply: Reply | None = None
    winner: int | None = None
    replaced: bool = False  # its rows were handed to other parts
    verifiers: list["Part"] = field(default_factory=list)  # role SERVE: open spot-check parts
    confirmed: bool = False  # role SERVE: a spot check computed the same answer
    after: "Part | None" = None  # a piece of a cut share (dispatch/chunks.py): sent once the piece before it is done
    expected: tuple[list[int], list[int]] | None = None  # exact mode: the experts and rows its answer must carry

    @property
    def done(self) -> bool:
        return self.reply is not None or self.replaced

    @property
    def counts(self) -> bool:
        """Whether its answer is one the call combines."""
        return self.role == SERVE and self.reply is not None and not self.replaced


@dataclass(eq=False)
class Attempt:
    part: Part
    worker: int
    pending: Pending
    deadline: float  # time.monotonic()
    timeout_s: float  # the deadline's distance from the send, for the message
    hedge_at: float | None  # time.monotonic(); None: not hedged
    hedge: bool = False  # this attempt is itself a hedged duplicate
    hedged: bool = False  # a duplicate of it was sent
