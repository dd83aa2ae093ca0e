"""Holders joining and leaving while a model runs: requested from any thread, applied between layer calls.

Discovery (discovery/follow.py) finds workers arriving and going on its own thread; the swarm
(swarm_members.py) turns each of its events into a `Change` and hands it to the dispatcher's one
method for it (`Dispatcher.change_members`); the forward runs on another thread. A change is
queued here and the dispatcher applies the queue at the start of its next layer call (or when
asked, before anything runs), so no layer call ever sees its holders change under it. A holder
that leaves stays in the pool as a tombstone (never usable again) until it is pruned, between
layer calls (dispatch/pool.py); a worker that comes back is a new holder.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from moeswarm.transport.link import WorkerLink

JOIN, LEAVE = "join", "leave"
LEFT_CAUSE = "left the swarm (its announcement expired or was withdrawn)"


@dataclass(frozen=True)
class Change:
    kind: str  # JOIN or LEAVE
    link: WorkerLink  # a connected link (JOIN: HELLO done), or the link of the holder that leaves
    path: str | None = None  # JOIN: how the worker is reached ("direct" or "relay", transport/path.py)

    @classmethod
    def join(cls, link: WorkerLink, path: str | None = None) -> "Change":
        return cls(JOIN, link, path)

    @classmethod
    def leave(cls, link: WorkerLink) -> "Change":
        return cls(LEAVE, link)


class MembershipQueue:
    def __init__(self):
        self._lock = threading.Lock()
        self._changes: list[Change] = []

    def put(self, change: Change) -> None:
        with self._lock:
            self._changes.append(change)

    def __bool__(self) -> bool:
        return bool(self._changes)  # a racy read is fine: a change missed now is applied at the next call

    def take(self) -> list[Change]:
        """The changes queued so far, in order; the queue is left empty."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes
