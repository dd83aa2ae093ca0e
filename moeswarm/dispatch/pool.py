"""The holders a dispatcher sends to: each one's link and standing, the placement table over them,
and the moves on them: choose, probe, take down, ban.

Holders are numbered by their place in `links` (a `WorkerId`); `holders[w]` is holder w's standing
(dispatch/health.py), `table` the placement over every member's announced experts. A layer call in
flight (dispatch/flight.py) and verification (dispatch/verify.py) act on holders only through this
pool's methods.

Holders join and leave between layer calls (`admit`, `retire`, from dispatch/membership.py's
queue); one that left stays as a tombstone (never usable again) until `prune` drops it and
renumbers the others. `epoch` counts the changes of numbering or table: whatever is cached over
them (dispatch/owners.py) is stale once it moves.

The answers each layer call used without a spot check confirming them are kept per holder
(dispatch/taint.py); a ban turns the calls that used the liar's unchecked answers into a `Taint`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from moeswarm.dispatch.accounting import Resilience
from moeswarm.dispatch.health import DeadlinePolicy, Holder
from moeswarm.dispatch.taint import Ledger, Taint
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.ids import WorkerId
from moeswarm.placement.chooser import choose_owners
from moeswarm.placement.table import PlacementTable, build_table, missing
from moeswarm.transport.fanout import ready
from moeswarm.transport.link import WorkerLink
from moeswarm.worker.local_link import LOCAL_ADDRESS
from moeswarm.wire.result_size import DEFAULT_MAX_RESULT_BYTES

PRUNE_AFTER_S = 600.0  # how long a holder that left stays a tombstone
PRUNE_AT = 64  # ... unless this many tombstones accumulate first


class HolderPool:
    def __init__(self, links: Sequence[WorkerLink], table: PlacementTable, policy: DeadlinePolicy, stats: Resilience):
        self.links = list(links)
        self.table = table
        self.policy = policy
        self.stats = stats
        self.holders = [Holder(policy) for _ in self.links]
        self.trusted = {WorkerId(i) for i, link in enumerate(self.links) if link.address == LOCAL_ADDRESS}
        self.gone: set[WorkerId] = set()  # holders that left the swarm: tombstones, never usable again
        self.gone_at: dict[WorkerId, float] = {}  # time.monotonic() each left
        self.prune_after_s = PRUNE_AFTER_S
        self.epoch = 0  # bumped when the numbering or the table changes
        self.ledger = Ledger()  # per holder: the calls that used its unchecked answers
        self._taints: list[Taint] = []  # bans not yet taken

    def address_of(self, worker: int) -> str:
        return self.links[worker].address

    def usable(self, worker: int) -> bool:
        return self.holders[worker].usable

    def reply_bound(self, worker: int) -> int | None:
        """The largest RESULT `worker` sends (its HELLO's `max_result_bytes`; a worker that does not say
        has the default bound); None for a holder in this process, which has none."""
        if worker in self.trusted:
            return None
        bound = getattr(self.links[worker].info, "max_result_bytes", None)
        return DEFAULT_MAX_RESULT_BYTES if bound is None else bound

    # -- choosing --------------------------------------------------------------------------

    def choose(self, layer: int, experts: Sequence[int], exclude: Collection[int] = ()) -> torch.Tensor:
        """[E] long: a usable holder for each of `experts` outside `exclude` (-1: none)."""
        return choose_owners(self.table, layer, lambda w: self.holders[w].usable and w not in exclude,
                             self.trusted, experts)

    def replica_for(self, layer: int, experts: Sequence[int], exclude: Collection[int]) -> int | None:
        """A usable holder of every one of `experts`, outside `exclude` (for a hedged duplicate or a check)."""
        common = None
        for expert in experts:
            here = {w for w in self.table.holders(layer, expert) if self.holders[w].usable and w not in exclude}
            common = here if common is None else common & here
        return min(common) if common else None

    # -- standing --------------------------------------------------------------------------

    def ready(self, worker: int, first_ping: bool = True) -> bool:
        """Reconnect `worker`'s broken link before use (first_ping: and PING it if it never was, for
        its first deadline); a failure takes it down (False)."""
        holder, link = self.holders[worker], self.links[worker]
        try:
            ready(link, self.policy.probe_timeout_s)
            if first_ping and holder.ping_s is None and worker not in self.trusted and holder.usable:
                holder.ping_s = link.ping(self.policy.probe_timeout_s)  # its first deadline
        except (MoeSwarmError, OSError) as error:
            self.take_down(WorkerId(worker), getattr(error, "cause", None) or str(error))
            return False
        return True

    def take_down(self, worker: WorkerId, cause: str) -> None:
        """`worker` failed: close its link and keep it out of use until a probe succeeds."""
        holder = self.holders[worker]
        self.links[worker].close()
        if holder.up and not holder.banned:
            holder.fail(time.monotonic(), cause)
            self.stats.takedowns += 1

    def ban(self, worker: WorkerId, cause: str) -> None:
        """`worker` lied: never used again in this session; the calls that used its unchecked answers are a taint."""
        self.holders[worker].ban(cause)
        self.links[worker].close()
        self.stats.bans += 1
        self._taints.append(Taint(self.links[worker].address, cause, self.ledger.runs(worker)))
        self.ledger.forget(worker)

    def take_taints(self) -> list[Taint]:
        """The bans since the last take, each with the layer calls that used the liar's unchecked answers."""
        taints, self._taints = self._taints, []
        return taints

    def probe(self, worker: int) -> bool:
        """Reconnect a down holder (HELLO, same experts) and PING it; readmit it on success."""
        holder, link = self.holders[worker], self.links[worker]
        if holder.banned or worker in self.gone:
            return False
        try:
            link.reconnect(self.policy.probe_timeout_s)
            holder.ping_s = link.ping(self.policy.probe_timeout_s)
        except (MoeSwarmError, OSError) as error:
            link.close()
            holder.up = True  # fail() counts the failure and doubles the backoff
            holder.fail(time.monotonic(), getattr(error, "cause", None) or str(error))
            return False
        holder.readmit()
        self.stats.readmissions += 1
        return True

    def probe_holders(self, wanted: Mapping[int, Iterable[int]], skip: set[int] | None = None) -> None:
        """The last resort before failing a call: probe every holder out of use of `wanted`
        ({layer: experts} nobody usable holds) now, backoff or not. skip: holders already probed
        (each one added): a holder that fails again is not probed in a loop."""
        skip = set() if skip is None else skip
        candidates = {w for layer, experts in wanted.items() for e in experts for w in self.table.holders(layer, e)}
        for worker in sorted(candidates - skip):
            skip.add(worker)
            if not self.holders[worker].usable:
                self.probe(worker)

    def readmit(self, due_only: bool = True) -> None:
        """Probe the down holders whose backoff has run out (all of them: due_only=False)."""
        now = time.monotonic()
        for worker, holder in enumerate(self.holders):
            if not holder.up and not holder.banned and worker not in self.gone and (not due_only or holder.retry_at <= now):
                self.probe(worker)

    def ping_usable(self, timeout_s: float) -> None:
        """PING every usable holder; one that does not answer is taken down."""
        for worker, (link, holder) in enumerate(zip(self.links, self.holders)):
            if holder.usable:
                try:
                    holder.ping_s = link.ping(timeout_s)
                except (MoeSwarmError, OSError) as error:
                    self.take_down(WorkerId(worker), getattr(error, "cause", None) or str(error))

    def gaps(self, layers: Sequence[int]) -> dict:
        """{layer: experts} of `layers` that no usable holder holds."""
        usable = {WorkerId(i): link.info.held for i, (link, h) in enumerate(zip(self.links, self.holders)) if h.usable}
        return missing(build_table(usable, self.table.num_experts), layers)

    def out_of_use(self) -> list[str]:
        """One line per member out of use: its address, banned or down, and why."""
        return [str(WorkerError(link.address, ("banned: " if h.banned else "down: ") + h.cause))
                for i, (link, h) in enumerate(zip(self.links, self.holders)) if not h.usable and i not in self.gone]

    def standing(self) -> list[dict]:
        """Per holder: up, banned, degraded, failures, cause, PING and round-trip quantiles (ms)."""
        return [{"worker": link.address, "up": h.up, "banned": h.banned, "degraded": h.degraded, "failures": h.failures,
                 "cause": h.cause, "ping_ms": None if h.ping_s is None else 1000 * h.ping_s,
                 "rtt_ms": h.round_trips.summary_ms()} for link, h in zip(self.links, self.holders)]

    # -- members joining and leaving (between layer calls only) ---------------------------

    def admit(self, link: WorkerLink) -> None:
        """A connected link (HELLO done) becomes a new holder; call `rebuild` after the last change."""
        self.links.append(link)
        self.holders.append(Holder(self.policy))
        if link.address == LOCAL_ADDRESS:
            self.trusted.add(WorkerId(len(self.links) - 1))

    def retire(self, link: WorkerLink, cause: str) -> None:
        """The holder of `link` left: a tombstone from now on (its link closed)."""
        worker = next((WorkerId(i) for i, member in enumerate(self.links) if member is link), None)
        if worker is None or worker in self.gone:
            return
        self.gone.add(worker)
        self.gone_at[worker] = time.monotonic()
        holder = self.holders[worker]
        holder.up, holder.cause = False, cause
        link.close()

    def rebuild(self) -> None:
        """The placement table over the members (not the tombstones), after joins or leaves."""
        held = {WorkerId(i): link.info.held for i, link in enumerate(self.links) if i not in self.gone and link.info}
        self.table = build_table(held, self.table.num_experts)
        self.epoch += 1

    def prune_due(self) -> bool:
        """Whether the oldest tombstone is due to be dropped."""
        return bool(self.gone_at) and time.monotonic() - min(self.gone_at.values()) >= self.prune_after_s

    def prune(self) -> None:
        """Drop the tombstones older than `prune_after_s` (all of them past `PRUNE_AT`): their links,
        standing and ledger; the other holders are renumbered. Only with no layer call in flight."""
        now = time.monotonic()
        due = {w for w in self.gone if now - self.gone_at.get(w, now) >= self.prune_after_s or len(self.gone) >= PRUNE_AT}
        if not due:
            return
        keep = [i for i in range(len(self.links)) if i not in due]
        renumber = {WorkerId(old): WorkerId(new) for new, old in enumerate(keep)}
        for worker in due:
            self.links[worker].close()
        self.links = [self.links[i] for i in keep]
        self.holders = [self.holders[i] for i in keep]
        self.trusted = {renumber[w] for w in self.trusted if w in renumber}
        self.gone = {renumber[w] for w in self.gone if w in renumber}
        self.gone_at = {renumber[w]: t for w, t in self.gone_at.items() if w in renumber}
        self.ledger.rekey(renumber)
        self.rebuild()
        self.stats.pruned += len(due)

    def members(self) -> list[WorkerLink]:
        """The links of the holders that have not left."""
        return [link for i, link in enumerate(self.links) if i not in self.gone]

    def close(self) -> None:
        for link in self.links:
            link.close()
