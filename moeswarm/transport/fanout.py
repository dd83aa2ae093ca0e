"""Fan-out: one layer's requests to their holders, and their replies back.

`star` sends every request before awaiting any reply (one round trip per layer, bounded by the
slowest holder); `chain` awaits each reply before the next send (for measurement: the sum of the
round trips).

Whatever fails, every link is left in step for the next layer: all requests are encoded before
any is sent (a codec that refuses its input sends nothing); after a failure the other links'
replies are still awaited (drained), and a link whose stream broke has closed itself and is
reconnected before its next request. The first error is raised, naming the worker and the cause.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from moeswarm.errors import WorkerError
from moeswarm.transport.link import Pending, Reply, WorkerLink
from moeswarm.wire.messages import Dispatch

DRAIN_TIMEOUT_S = 10.0  # how long, after one holder failed, the others' replies are awaited


@dataclass(frozen=True)
class Sent:
    worker: int  # index into the links
    pending: Pending


def ready(link: WorkerLink) -> None:
    """Reconnect a link that broke during an earlier call."""
    if link.broken:
        link.reconnect()


def submit(links: Sequence[WorkerLink], requests: Sequence[tuple[int, Dispatch]]) -> list[Sent]:
    """Send each (worker, request); on a failure, drain what was sent and raise."""
    for worker, _ in requests:
        ready(links[worker])
    prepared = [(worker, links[worker].prepare(request)) for worker, request in requests]
    sent: list[Sent] = []
    for worker, item in prepared:
        try:
            sent.append(Sent(worker, links[worker].send(item)))
        except WorkerError:
            gather(links, sent, time.monotonic() + DRAIN_TIMEOUT_S, raise_first=False)
            raise
    return sent


def gather(links: Sequence[WorkerLink], sent: Sequence[Sent], deadline: float,
           raise_first: bool = True) -> list[Reply]:
    """Every sent request's reply, in order; after a failure the rest are still awaited."""
    replies: list[Reply] = []
    first: WorkerError | None = None
    for item in sent:
        try:
            replies.append(links[item.worker].wait(item.pending, deadline))
        except WorkerError as error:
            first = first or error
    if first is not None and raise_first:
        raise first
    return replies
