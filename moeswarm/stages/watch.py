"""A running gateway following its swarm's stages (`StageWatch`): replicas added, the route re-planned.

stages/find.py finds the route at start and hands the watch its finder (the DHT still joined,
what was dialled, each round trip with when it was measured). Every `follow_s` the watch reads the
records again, which dials the stages new since and measures again those whose round trip is
`remeasure_s` old (a bounded number per read, oldest first; one that no longer answers is left
out and dialled as new): a stage holding exactly one of the chain's spans joins its replicas
(`Chain.add_replica`); a route of the stages read, at their round trips as now measured, that is
cheaper than the chain's by a clear margin (stages/route_move.py `better_route`: round trips plus
a weight per stage) becomes its route between two steps (`Chain.reroute`, the step log replayed:
bit-identical), so a stage in use whose link slowed down is left for a route now cheaper; and a
chain whose span lost every replica asks `replan` for a route of the stages alive (docs/stages.md,
Finding stages on the DHT).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from moeswarm.errors import one_line, printable
from moeswarm.stages.route import RouteError, plan_route
from moeswarm.stages.route_move import better_route, in_use_cost

if TYPE_CHECKING:
    from moeswarm.stages.find import _StageFinder

log = logging.getLogger("moeswarm.gateway")


class StageWatch:
    """The stages found at start (`route`), and the swarm still joined: `follow(chain)` adds the
    stages announced later to the chain's spans as replicas and moves the chain to a clearly cheaper
    route, from a thread, until `close`; `replan` answers a chain whose span lost every replica.
    `offers`: the stages of the last read, each with its round trip (for a status page)."""

    def __init__(self, finder: "_StageFinder", route: list[list[str]]):
        self.route = route
        self._finder = finder
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._reading = threading.Lock()  # the finder's state: the watch's thread and a chain's replan

    @property
    def offers(self) -> list:
        """The stages of the last read that this gateway may use (route.py Offers, with their round trips)."""
        return list(self._finder.latest)

    def follow(self, chain) -> None:
        """Every `follow_s`, read the records: each new stage holding exactly one of `chain`'s spans
        joins it, and a clearly cheaper route replaces the chain's; `chain.replan` is set to `replan`,
        `chain.offered` to the stages of the last read."""
        if self._thread is not None or self._closed:
            return
        chain.replan = self.replan
        chain.offered = lambda: self.offers
        self._thread = threading.Thread(target=self._follow, args=(chain,), name="moeswarm-stage-watch", daemon=True)
        self._thread.start()

    def read_once(self, chain) -> list[str]:
        """One read (round trips `remeasure_s` old measured again): the addresses that joined `chain`
        (each said once); then, when the stages read tile the model in a route clearly cheaper than
        `chain`'s at their round trips as now measured (`better_route`), the chain moves to it."""
        with self._reading:
            offers = self._finder.offers()
        joined = []
        for offer in offers:
            rtts = {o.address: o.rtt_ms for o in offers if o.layers == offer.layers}
            if chain.add_replica(offer.layers, offer.address, rtts):
                joined.append(offer.address)
                self._finder.report(f"stage {offer.address} joined as a replica of layers "
                                    f"{offer.layers.start}-{offer.layers.stop - 1}")
        in_use = list(zip(chain.spans or (), chain.route))
        best = better_route(offers, self._finder.num_layers, in_use)
        if best is not None:
            before, cost = chain.describe(), in_use_cost(offers, in_use)
            if chain.reroute([list(p.replicas) for p in best]):
                now = in_use_cost(offers, list(zip(chain.spans or (), chain.route)))
                self._finder.report(f"re-planned the route: {chain.describe()} (cost {now:.1f} ms; was {before}, "
                                    f"{cost:.1f} ms)")
            else:
                self._forget(p for position in best for p in position.replicas)
        return joined

    def replan(self, dead: set[str]) -> list[list[str]] | None:
        """A route of the stages announced now but `dead` (addresses: dialled again before use), or None."""
        self._forget(dead)
        with self._reading:
            offers = [o for o in self._finder.offers() if o.address not in dead]
        try:
            route = plan_route(offers, self._finder.num_layers)
        except RouteError as error:
            self._finder.report(f"no other route of the stages alive: {error}")
            return None
        self._finder.report("re-planned the route: " + ", ".join(
            f"layers {p.layers.start}-{p.layers.stop - 1} at {'|'.join(p.replicas)}" for p in route))
        return [list(p.replicas) for p in route]

    def _forget(self, addresses) -> None:
        """Dial these stages again at the next read (they failed since they answered)."""
        addresses = set(addresses)
        with self._reading:
            for key in [k for k in self._finder.answered if k[0] in addresses]:
                del self._finder.answered[key]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._finder.search.probe_timeout_s * 2 + 5)
        self._finder.dht.close()

    def _follow(self, chain) -> None:
        while not self._stop.wait(self._finder.search.follow_s):
            try:
                self.read_once(chain)
            except Exception as error:  # a failed read (the DHT, a probe): the chain goes on as it is
                log.warning("reading the swarm for new stages failed: %s", printable(one_line(error), 300))
