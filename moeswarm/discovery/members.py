"""A backbone's members as discovery sees them: connect a worker that announced itself, drop one that left.

`Members` sits between the follower (discovery/follow.py, on its own thread) and the
dispatcher: `join` dials an announced worker (direct or through its relay, transport/path.py), checks
its HELLO against the model and against its own announcement, and queues the connected link
into the dispatcher; `leave` queues a holder out. The dispatcher applies both between layer calls.
`follow_swarm` builds a backbone's dispatcher this way (swarm.py's `open_swarm(discovery=...)`).
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence

from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.dispatch.membership import Change
from moeswarm.errors import WorkerError
from moeswarm.ids import ExpertId, LayerId, WorkerId, format_ids
from moeswarm.discovery.dht import SwarmDht
from moeswarm.discovery.follow import DiscoveryOptions, Follower
from moeswarm.discovery.record import Announcement
from moeswarm.transport.path import worker_link
from moeswarm.placement.table import build_table, missing
from moeswarm.transport.link import WorkerLink

JOIN_TIMEOUT_S = 5.0  # connect and HELLO of an announced worker: an address that does not answer costs no more


def check_holder(link: WorkerLink, num_experts: int, hidden_size: int, layers: Sequence[int]) -> None:
    """WorkerError unless the connected `link`'s HELLO fits the model: its experts and width, its layers."""
    info = link.info
    if info.num_experts != num_experts or info.hidden_size != hidden_size:
        raise WorkerError(link.address, f"announces {info.num_experts} experts of width {info.hidden_size}, "
                                        f"the model has {num_experts} of width {hidden_size}")
    strays = sorted(set(info.held) - set(layers))
    if strays:
        raise WorkerError(link.address, f"announces experts of layers {strays[:8]}, which are not MoE layers "
                                        f"of this model (MoE layers: {format_ids(sorted(layers))})")


class Members:
    """The dispatcher's remote holders, keyed by announced address."""

    def __init__(self, dispatcher: Dispatcher, fingerprint: str, num_experts: int, hidden_size: int,
                 layers: Sequence[int], tls: ssl.SSLContext | None):
        self.dispatcher = dispatcher
        self.fingerprint = fingerprint
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.layers = list(layers)
        self.tls = tls
        self._lock = threading.Lock()
        self._links: dict[str, WorkerLink] = {}  # announced address -> its link (joined, maybe not yet applied)

    def current(self) -> dict[str, dict[int, tuple[int, ...]]]:
        """{address: experts its HELLO announced} of every member that has not left."""
        with self._lock:
            return {address: dict(link.info.held) for address, link in self._links.items()}

    def join(self, record: Announcement) -> None:
        """Connect the worker `record` announces and queue it in; WorkerError (link closed) if it does not fit."""
        kind, link = worker_link(record.address, tls=self.tls)
        try:
            link.connect(self.fingerprint, JOIN_TIMEOUT_S)
            check_holder(link, self.num_experts, self.hidden_size, self.layers)
            if link.info.held != record.held:
                raise WorkerError(link.address, "its HELLO announces other experts than its DHT record")
        except BaseException:
            link.close()
            raise
        with self._lock:  # joins run in parallel (discovery/follow.py)
            paths = dict(self.dispatcher.accounting.paths)  # a new dict: the forward's thread may be reading the old one
            paths[link.address] = kind
            self.dispatcher.accounting.paths = paths
            self._links[record.address] = link
        self.dispatcher.change_members(Change.join(link))

    def leave(self, address: str) -> None:
        with self._lock:
            link = self._links.pop(address, None)
        if link is not None:
            self.dispatcher.change_members(Change.leave(link))

    def gaps(self) -> dict[LayerId, list[ExpertId]]:
        """Apply the queued joins and leaves, then {layer: experts nobody holds}. Only while no forward
        runs (waiting for cover at start): during a forward the dispatcher applies them itself."""
        self.dispatcher.apply_membership()
        return missing(self.dispatcher.table, self.layers)


class Following:
    """The discovery side of an open swarm: its DHT node and the follower thread; `close` ends both."""

    def __init__(self, dht: SwarmDht, follower: Follower | None = None):
        self.dht = dht
        self.follower = follower

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.dht.close()


def open_dht(options: DiscoveryOptions) -> Following:
    """Join the swarm as a client (before the backbone loads: a bad peer fails fast, the DHT process forks small)."""
    from moeswarm.transport.member_cert import Authority

    authority = Authority.load(options.swarm_key) if options.swarm_key else None
    return Following(SwarmDht.open(options.peers, client=True, authority=authority))


def follow_swarm(following: Following, options: DiscoveryOptions, links: Sequence[WorkerLink], fingerprint: str,
                 num_experts: int, hidden_size: int, layers: Sequence[int], tls: ssl.SSLContext | None,
                 **dispatcher_options) -> Dispatcher:
    """A dispatcher over `links` (held in this process, if any) and the workers announced on the swarm:
    waits until they cover every MoE layer, then keeps following joins and leaves on a thread.

    dispatcher_options: the Dispatcher's wire, fanout, policy and spot_checks.
    """
    dispatcher = None
    try:
        for link in links:
            link.connect(fingerprint)
        held = {WorkerId(i): link.info.held for i, link in enumerate(links)}
        dispatcher = Dispatcher(links, build_table(held, num_experts), **dispatcher_options)
        members = Members(dispatcher, fingerprint, num_experts, hidden_size, layers, tls)
        follower = Follower(following.dht, fingerprint, members, tls is not None, options.poll_s)
        follower.wait_for_cover(options.wait_s, options.report)
    except BaseException:
        if dispatcher is not None:
            dispatcher.apply_membership()  # links joined in the last round, too
            dispatcher.close()
        for link in links:
            link.close()
        raise
    follower.start()
    following.follower = follower
    return dispatcher
