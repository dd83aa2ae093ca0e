"""The swarm applying discovery's events: dial a worker that joined, check it, hand it to the dispatcher.

Discovery (discovery/members.py) emits plain events: `Joined` (an announced address and the
experts its record claims) and `Left`. `MemberLinks` is their sink: for a join it dials the
address (direct or through its relay, transport/path.py's policy), checks the worker's HELLO
against the model and against its record, and queues the connected link into the dispatcher with
`change_members` (thread-safe; applied between layer calls); for a leave it queues the member's
link out. Joins run in parallel on discovery's threads; a refused join raises `WorkerError`.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence

from moeswarm.discovery.members import Event, Joined
from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.dispatch.membership import Change
from moeswarm.errors import WorkerError
from moeswarm.ids import format_ids
from moeswarm.transport.link import WorkerLink
from moeswarm.transport.path import worker_link

JOIN_TIMEOUT_S = 5.0  # connect and HELLO of an announced worker: an address that does not answer costs no more


def check_holder(link: WorkerLink, num_experts: int, hidden_size: int, layers: Sequence[int]) -> None:
    """WorkerError unless the connected `link`'s HELLO fits the model: its experts and width, and
    layers among `layers` (the model's MoE layers: a stage uses a holder of more than its span)."""
    info = link.info
    if info.num_experts != num_experts or info.hidden_size != hidden_size:
        raise WorkerError(link.address, f"announces {info.num_experts} experts of width {info.hidden_size}, "
                                        f"the model has {num_experts} of width {hidden_size}")
    strays = sorted(set(info.held) - set(layers))
    if strays:
        raise WorkerError(link.address, f"announces experts of layers {strays[:8]}, which are not MoE layers "
                                        f"of this model (MoE layers: {format_ids(sorted(layers))})")


class MemberLinks:
    """The links of the workers joined from the swarm, keyed by announced address."""

    def __init__(self, dispatcher: Dispatcher, fingerprint: str, num_experts: int, hidden_size: int,
                 layers: Sequence[int], tls: ssl.SSLContext | None):
        self.dispatcher = dispatcher
        self.fingerprint = fingerprint
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.layers = list(layers)  # the model's MoE layers, all of them: see check_holder
        self.tls = tls
        self._lock = threading.Lock()
        self._links: dict[str, WorkerLink] = {}  # announced address -> its link (queued into the dispatcher)

    def __call__(self, event: Event) -> None:
        if isinstance(event, Joined):
            self._join(event)
            return
        with self._lock:
            link = self._links.pop(event.address, None)
        if link is not None:
            self.dispatcher.change_members(Change.leave(link))

    def _join(self, event: Joined) -> None:
        """Dial and check `event`'s worker, then queue it in; WorkerError (link closed) if it does not fit."""
        path, link = worker_link(event.address, tls=self.tls)
        try:
            link.connect(self.fingerprint, JOIN_TIMEOUT_S)
            check_holder(link, self.num_experts, self.hidden_size, self.layers)
            if dict(link.info.held) != dict(event.held):
                raise WorkerError(link.address, "its HELLO announces other experts than its DHT record")
        except BaseException:
            link.close()
            raise
        with self._lock:
            self._links[event.address] = link
        self.dispatcher.change_members(Change.join(link, path))
