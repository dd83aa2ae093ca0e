"""The swarm's coverage, two ways: as its DHT announces it (what `moeswarm status INVITE` prints),
and as the members alive at a moment hold it (from their own lines), which decides whether a
failed layer call had a holder it could have used."""

from __future__ import annotations

import time
from dataclasses import dataclass

from moeswarm.errors import MoeSwarmError
from moeswarm_bench.bench.swarm_procs import Joiner


@dataclass(frozen=True)
class Snapshot:
    at: float
    members: frozenset[str]
    fewest: int  # holders of the least-held (layer, expert) pair
    uncovered: int  # (layer, expert) pairs nobody announced

    def to_json(self) -> dict:
        return {"members": len(self.members), "fewest": self.fewest, "uncovered_pairs": self.uncovered}


class Coverage:
    """The swarm's coverage as its DHT announces it (what `moeswarm status INVITE` prints)."""

    def __init__(self, dht, model: str, layers: list[int], num_experts: int):
        self.dht, self.model, self.layers, self.num_experts = dht, model, layers, num_experts

    def read(self) -> Snapshot:
        from moeswarm.placement.share import coverage_of

        records = self.dht.fetch(self.model)
        coverage = coverage_of([r.held for r in records.values()], self.layers, self.num_experts)
        holders = [h for row in coverage.values() for h in row]
        return Snapshot(time.monotonic(), frozenset(records), min(holders), sum(h == 0 for h in holders))

    def wait(self, done, wait_s: float) -> Snapshot:
        """The first reading that is `done`; MoeSwarmError naming the last after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            snapshot = self.read()
            if done(snapshot):
                return snapshot
            if time.monotonic() > deadline:
                raise MoeSwarmError(f"the swarm's announcements did not settle within {wait_s:g} s: {snapshot}")
            time.sleep(0.25)


def alive_fewest(joiners: list[Joiner], when: float, num_experts: int) -> int:
    """Holders of the least-held expert among the members serving at `when` (the same experts at every layer)."""
    holders = [0] * num_experts
    for joiner in joiners:
        for expert in joiner.share_at(when) or ():
            holders[expert] += 1
    return min(holders)
