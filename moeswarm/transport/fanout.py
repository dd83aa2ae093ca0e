"""Fan-out primitives: send one request on a link, and wait until some links have a reply.

The dispatcher (dispatch/flight.py) keeps several requests in flight over several links at once
(each holder's share, hedged duplicates, spot checks) and reacts to whichever reply comes first.
These helpers are the only place that touches the links' sockets for that: `send` prepares and
sends (a codec that refuses its input raises before any byte goes out), `readable` selects on
the links that have a socket and returns those with something to read.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from dataclasses import dataclass

from moeswarm.transport.link import Pending, WorkerLink
from moeswarm.wire.messages import Dispatch


@dataclass(frozen=True)
class Sent:
    worker: int  # index into the links
    pending: Pending


def ready(link: WorkerLink, timeout_s: float | None = None) -> None:
    """Reconnect a link that broke during an earlier call."""
    if link.broken:
        link.reconnect(timeout_s)


def send(links: Sequence[WorkerLink], worker: int, request: Dispatch) -> Sent:
    """Prepare and send `request` to `links[worker]`; WorkerError when the link fails."""
    link = links[worker]
    return Sent(worker, link.send(link.prepare(request)))


def readable(links: Sequence[WorkerLink], workers: set[int], timeout_s: float) -> list[int]:
    """Of `workers`, those whose socket has data (or EOF) within `timeout_s`."""
    by_fd, buffered = {}, []
    for worker in workers:
        if getattr(links[worker], "buffered", lambda: False)():  # a TLS socket may hold a record select cannot see
            buffered.append(worker)
        fd = links[worker].fileno()
        if fd is not None:
            by_fd[fd] = worker
    if buffered or not by_fd:
        return sorted(buffered)
    ready_fds, _, _ = select.select(list(by_fd), [], [], max(0.0, timeout_s))
    return sorted(by_fd[fd] for fd in ready_fds)
