"""A backbone's members as discovery sees them: events out, nothing else touched.

`Members` sits between the follower (discovery/follow.py, on its own thread) and whoever uses
the swarm: `join` emits a `Joined` event (plain data: the announced address and the experts its
record claims), `leave` a `Left`. The sink they go to (swarm_members.py, given by swarm.py) dials
the worker, checks its HELLO and hands it to the dispatcher; a sink that raises `WorkerError`
refuses the join (the follower retries with backoff). Members keeps only what it needs to follow:
the addresses joined and what they hold, and so which experts nobody holds yet (`gaps`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from moeswarm.discovery.dht import SwarmDht
from moeswarm.discovery.follow import DiscoveryOptions, Follower
from moeswarm.discovery.record import Announcement
from moeswarm.ids import ExpertId, LayerId, WorkerId
from moeswarm.placement.table import build_table, missing


@dataclass(frozen=True)
class Joined:
    """A worker announced on the swarm: its address as announced, and the experts its record claims."""

    address: str
    held: Mapping[int, tuple[int, ...]]  # {MoE layer: experts, ascending}


@dataclass(frozen=True)
class Left:
    """A member's record is gone (expired, or withdrawn on a clean exit)."""

    address: str


Event = Joined | Left


class Members:
    """The workers joined from the swarm, keyed by announced address; each change is an event to `sink`."""

    def __init__(self, sink: Callable[[Event], None], num_experts: int, layers: Sequence[int],
                 held_here: Mapping[int, tuple[int, ...]] | None = None):
        """sink: applies each event (thread-safe: joins run in parallel); raises WorkerError to refuse a join.
        held_here: {layer: experts} held in this process, which count toward cover."""
        self.sink = sink
        self.num_experts = num_experts
        self.layers = list(layers)
        self.held_here = dict(held_here or {})
        self._lock = threading.Lock()
        self._joined: dict[str, dict[int, tuple[int, ...]]] = {}  # announced address -> experts it holds

    def current(self) -> dict[str, dict[int, tuple[int, ...]]]:
        """{address: experts its record (checked against its HELLO) announced} of every member that has not left."""
        with self._lock:
            return dict(self._joined)

    def join(self, record: Announcement) -> None:
        """Emit `record`'s worker joining; WorkerError (nothing joined) when the sink refuses it."""
        held = {int(layer): tuple(experts) for layer, experts in record.held.items()}
        self.sink(Joined(record.address, held))
        with self._lock:
            self._joined[record.address] = held

    def leave(self, address: str) -> None:
        with self._lock:
            if self._joined.pop(address, None) is None:
                return
        self.sink(Left(address))

    def gaps(self) -> dict[LayerId, list[ExpertId]]:
        """{layer: experts} of the model's MoE layers that neither a member nor this process holds."""
        held = {WorkerId(i + 1): experts for i, experts in enumerate(self.current().values())}
        if self.held_here:
            held[WorkerId(0)] = self.held_here
        return missing(build_table(held, self.num_experts), self.layers)


class Following:
    """The discovery side of an open swarm: its DHT node and the follower thread; `close` ends both."""

    def __init__(self, dht: SwarmDht, follower: Follower | None = None):
        self.dht = dht
        self.follower = follower

    def follow(self, options: DiscoveryOptions, fingerprint: str, members: Members, tls: bool) -> None:
        """Join announced workers (through `members`' events) until they cover every MoE layer
        (MoeSwarmError after `options.wait_s`), then keep following joins and leaves on a thread."""
        follower = Follower(self.dht, fingerprint, members, tls, options.poll_s)
        follower.wait_for_cover(options.wait_s, options.report)
        follower.start()
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
