"""A backbone following the swarm: wait until the announced workers cover the model, then keep up.

Every `poll_s` the follower reads the model's announcements from the DHT and compares them with
the members it has (`membership_diff`, a pure function): a worker that announced itself joins (an
event, discovery/members.py; the swarm dials and checks it); a member whose record is gone
(expired, or withdrawn on a clean exit) leaves. A member
that stops answering while its record lives is the dispatcher's business (failover, probes with
backoff) until the record expires. A worker that cannot be joined (unreachable, wrong model, a
HELLO that contradicts its record) is retried with backoff, and said once per cause.

On a keyed swarm several members may claim one address (a member may announce any address it
likes). The worker's own HELLO is what counts: a member stays joined on the claim that matches
it, and an address whose join failed is tried with its next claim at the next attempt, so a
member claiming another's address cannot keep that worker out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.ids import ExpertId, LayerId
from moeswarm.discovery.dht import SwarmDht
from moeswarm.discovery.record import Announcement
from moeswarm.placement.table import describe_gaps

log = logging.getLogger("moeswarm.discovery")

POLL_S = 2.0
WAIT_S = 60.0
RETRY_MAX_S = 60.0
JOINS_AT_ONCE = 8


@dataclass(frozen=True)
class DiscoveryOptions:
    """How a backbone finds its workers on the swarm (`--swarm`) instead of a `--workers` list.

    peers: multiaddrs of DHT peers to join by.
    wait_s: the most to wait at start for the announced workers to cover every MoE layer.
    poll_s: how often the announcements are read again.
    report: called with a line while waiting (None: logged).
    swarm_key: the `--swarm-key` file (the swarm key or a member file): only records signed by the
        swarm's members count (discovery/sign.py); None: an unkeyed swarm.
    """

    peers: tuple[str, ...]
    wait_s: float = WAIT_S
    poll_s: float = POLL_S
    report: Callable[[str], None] | None = None
    swarm_key: str | None = None


class MembersLike(Protocol):
    def current(self) -> dict[str, dict[int, tuple[int, ...]]]: ...
    def join(self, record: Announcement) -> None: ...
    def leave(self, address: str) -> None: ...
    def gaps(self) -> dict[LayerId, list[ExpertId]]: ...


def membership_diff(members: Mapping[str, Mapping[int, tuple[int, ...]]],
                    records: Mapping[str, Announcement]) -> tuple[list[Announcement], list[str]]:
    """(records to join, member addresses to leave). A member whose record now names other experts
    leaves and joins again (its HELLO is checked anew)."""
    leave = sorted(a for a, held in members.items() if a not in records or dict(records[a].held) != dict(held))
    join = [records[a] for a in sorted(records) if a not in members or a in leave]
    return join, leave


def _choose(claims: list[Announcement], held: Mapping[int, tuple[int, ...]] | None, turn: int) -> Announcement:
    """The claim of an address to follow: the one matching the joined member's HELLO (`held`), else the `turn`-th."""
    for claim in claims:
        if held is not None and dict(claim.held) == dict(held):
            return claim
    return claims[turn % len(claims)]


class Follower:
    def __init__(self, dht: SwarmDht, fingerprint: str, members: MembersLike, tls: bool, poll_s: float = POLL_S):
        self.dht = dht
        self.fingerprint = fingerprint
        self.members = members
        self.tls = tls
        self.poll_s = poll_s
        self._retry: dict[str, tuple[float, int]] = {}  # address -> (monotonic time of the next try, failures)
        self._turn: dict[str, int] = {}  # address -> which of its claims to try next
        self._said: set[str] = set()  # problems already logged
        self.records: dict[str, Announcement] = {}  # the record each address announced at the last look
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="moeswarm-discovery", daemon=True)

    def wait_for_cover(self, wait_s: float, report: Callable[[str], None] | None = None) -> None:
        """Join announced workers until every expert of every MoE layer has a holder (MoeSwarmError after `wait_s`)."""
        deadline = time.monotonic() + wait_s
        said = ""
        while True:
            self.step()
            gaps = self.members.gaps()
            if not gaps:
                return
            line = (f"waiting for workers on the swarm: {len(self.members.current())} joined, "
                    f"nobody holds {describe_gaps(gaps)}")
            if line != said:
                (report or log.warning)(line)
                said = line
            if time.monotonic() >= deadline:
                raise MoeSwarmError(f"no worker on the swarm holds {describe_gaps(gaps)} after {wait_s:g} s "
                                    f"({len(self.members.current())} workers joined)")
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    def start(self) -> None:
        """Keep following on a background thread until `stop`."""
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.step()
            except Exception as error:  # the DHT process going down, say: the next round tries again
                self._say(f"reading the swarm failed: {one_line(error)}")

    def step(self) -> None:
        """One look at the DHT: leaves first (their experts go to the others), then joins."""
        current = self.members.current()
        claims = {a: [r for r in found if self._fits(r)] for a, found in self.dht.claims(self.fingerprint).items()}
        records = {a: _choose(found, current.get(a), self._turn.get(a, 0)) for a, found in claims.items() if found}
        self.records = records  # replaced whole: readers on other threads see one look or the next
        join, leave = membership_diff(current, records)
        for address in leave:
            log.info("worker %s left the swarm", address)
            self.members.leave(address)
        now = time.monotonic()
        due = [r for r in join if self._retry.get(r.address, (0.0, 0))[0] <= now]
        if due:  # in parallel: addresses that do not answer hold the others up by one connect timeout at most
            with ThreadPoolExecutor(min(JOINS_AT_ONCE, len(due)), thread_name_prefix="moeswarm-join") as pool:
                for record, error in zip(due, pool.map(self._join, due)):
                    if error is None:
                        self._retry.pop(record.address, None)
                        log.info("worker %s joined from the swarm", record.address)
                        continue
                    failures = self._retry.get(record.address, (0.0, 0))[1]
                    self._turn[record.address] = self._turn.get(record.address, 0) + 1  # its next claim, next time
                    self._retry[record.address] = (now + min(RETRY_MAX_S, self.poll_s * 2 ** failures), failures + 1)
                    self._say(f"cannot use worker {record.address} announced on the swarm: {one_line(error)}")
        for address in [a for a in self._retry if a not in records]:
            del self._retry[address]
        for address in [a for a in self._turn if a not in records]:
            del self._turn[address]

    def _join(self, record: Announcement) -> MoeSwarmError | None:
        try:
            self.members.join(record)
        except MoeSwarmError as error:  # WorkerError included: unreachable, wrong model, HELLO against record
            return error
        return None

    def _fits(self, record: Announcement) -> bool:
        if record.tls != self.tls:
            need = "requires a swarm key (--swarm-key)" if record.tls else "serves plain TCP, and this backbone uses --swarm-key"
            self._say(f"skipping worker {record.address}: it {need}")
            return False
        return True

    def _say(self, message: str) -> None:
        if message not in self._said:
            if len(self._said) > 4096:
                self._said.clear()
            self._said.add(message)
            log.warning(message)
