"""Holders joining and leaving while a model runs: requested from any thread, applied between layer calls.

Discovery (discovery/follow.py) finds workers arriving and going on its own thread; the
forward runs on another. A change is queued here and the dispatcher applies the queue at the start
of its next layer call (or when asked, before anything runs), so no layer call ever sees its
holders change under it. Holder indices stay stable: a holder that leaves stays in the lists as a
tombstone (never usable again), so whatever is keyed by index stays valid, and a worker that comes
back is a new holder.
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
    link: WorkerLink  # a connected link (JOIN), or the link of the holder that leaves


class MembershipQueue:
    def __init__(self):
        self._lock = threading.Lock()
        self._changes: list[Change] = []

    def join(self, link: WorkerLink) -> None:
        with self._lock:
            self._changes.append(Change(JOIN, link))

    def leave(self, link: WorkerLink) -> None:
        with self._lock:
            self._changes.append(Change(LEAVE, link))

    def __bool__(self) -> bool:
        return bool(self._changes)  # a racy read is fine: a change missed now is applied at the next call

    def take(self) -> list[Change]:
        """The changes queued so far, in order; the queue is left empty."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes
