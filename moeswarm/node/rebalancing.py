"""A joined member keeping its share where the swarm needs it (`moeswarm join --rebalance SECONDS`).

Every period the member reads the announcements of its model from the DHT, adds its own share
(its record may not have spread yet), and asks placement/rebalance.py's `choose_mover` who moves,
each (layer, expert) weighed by the load its holders announce (placement/load.py).
Every member reads the same records and applies the same rule, so at most one member moves a
round (the one whose move gains most; ties: the smallest announced address), and only when the
gain passes the margin or fills a hole. Loads weigh a round only once the swarm has kept the same
members and shares for `settle_s` (`Settling`): a load is a rate over the last announcement TTL, so
after a join, a leave or a move the records still carry windows from before (and a new node's
first window undercounts the traffic backbones had not yet sent it); until then every pair weighs
1, and only holes and uneven holder counts move a share. The move, in an order that never leaves
an expert without a holder:

1. fetch the new share's slice (discovery/joining.py `fetch_share`: hashed, resumable) and load
   it into a second worker node on a free port, beside the one serving;
2. announce it: for a while the swarm sees both shares, the old and the new;
3. withdraw the old node's announcement, keep it answering for GRACE_S (backbones read the DHT
   every few seconds, discovery/follow.py's POLL_S, and drop it at their next look) and then until
   no row has been routed to it for QUIET_POLLS polls (a backbone on a loaded host joins the new
   node later than the grace: closing the old one under it left an expert with no usable holder
   for that backbone in `bench swarm`), at most DRAIN_MAX_GRACES graces; then close it.

What a record claims is what the member balances against: a lying record can skew a share, never
an answer (backbones trust a worker's HELLO, and exact mode's bits).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from moeswarm.discovery.follow import POLL_S
from moeswarm.errors import one_line
from moeswarm.ids import format_ids
from moeswarm.placement.load import swarm_load
from moeswarm.placement.rebalance import Move, choose_mover
from moeswarm.placement.share import coverage_of

if TYPE_CHECKING:
    from moeswarm.node.worker import WorkerNode

log = logging.getLogger("moeswarm.discovery")

GRACE_S = 3 * POLL_S  # the old node answers at least this long after its withdrawal,
QUIET_POLLS = 2  # then until no row was routed to it for this many polls in a row,
DRAIN_MAX_GRACES = 10  # and at most this many graces in all
DEFAULT_INTERVAL_S = 30.0
Held = Mapping[int, Sequence[int]]  # {MoE layer: experts}


def uniform_shares(helds: Mapping[str, Held], layers: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """{member: experts} of the members that hold one expert list at every MoE layer (joined members);
    only they may move (the others count toward coverage, as they are)."""
    shares = {}
    for address, held in helds.items():
        lists = {tuple(sorted(set(held.get(layer, ())))) for layer in layers}
        if len(lists) == 1 and set(held) <= set(layers) and (share := lists.pop()):
            shares[address] = share
    return shares


def plan_round(records: Mapping[str, tuple[Held, Held | None]], me: str, share: Sequence[int],
               layers: Sequence[int], num_experts: int, loads: bool = True) -> Move | None:
    """This member's move this round, or None (no move gains, or another member's gains more).

    records: {announced address: ({layer: experts}, its announced load or None)} as read from the
    DHT (placement/load.py weighs the pairs by the loads; with `loads` False every pair weighs 1);
    `me` holding `share` at every layer is put in whether or not its record was among them (with
    its announced load where it was)."""
    held = {layer: tuple(share) for layer in layers}
    announced, load = records.get(me, (None, None))
    mine = load if announced is not None and {n: tuple(e) for n, e in announced.items()} == held else None
    records = {**records, me: (held, mine)}
    helds = {address: held for address, (held, _) in records.items()}
    coverage = coverage_of(helds.values(), layers, num_experts)
    load = swarm_load(records.values(), layers, num_experts) if loads else None
    chosen = choose_mover(coverage, uniform_shares(helds, layers), load=load)
    return chosen[1] if chosen is not None and chosen[0] == me else None


class Settling:
    """Whether the swarm's members and shares have stayed the same for `settle_s` seconds.

    `settled(records)` is called each round with the records read ({address: (held, load)}); any
    change of addresses or of what they hold (a join, a leave, a move) starts the wait again, as
    does the first call."""

    def __init__(self, settle_s: float, clock: Callable[[], float] = time.monotonic):
        self.settle_s = settle_s
        self.clock = clock
        self._seen: frozenset | None = None
        self._since = 0.0

    def settled(self, records: Mapping[str, tuple[Held, Held | None]]) -> bool:
        now = self.clock()
        seen = frozenset((address, tuple(sorted((layer, tuple(sorted(experts))) for layer, experts in held.items())))
                         for address, (held, _) in records.items())
        if seen != self._seen:
            self._seen, self._since = seen, now
        return now - self._since >= self.settle_s


def settle_s(announce_ttl_s: float) -> float:
    """How long the swarm must stay the same before loads weigh: every record's load window (the
    last TTL, refreshed every TTL/3) then starts after backbones found the change (POLL_S)."""
    return 2 * announce_ttl_s + POLL_S


class Member:
    """A joined member: the worker node serving its share, replaced by another node when it moves.

    open_node(experts): fetch that share and build its node (blocking: run off the loop), not started.
    read(): {address: ({layer: experts}, its announced load or None)} of the model's announcements
    on the DHT (blocking). on_move(experts): called once a move is done, with the new share (the
    member's seed follows it: node/member_seed.py). settling: when loads weigh a round (None:
    `Settling(settle_s(its announcement's TTL))`)."""

    def __init__(self, node: WorkerNode, share: Sequence[int], layers: Sequence[int], num_experts: int,
                 open_node: Callable[[tuple[int, ...]], WorkerNode],
                 read: Callable[[], dict[str, tuple[Held, Held | None]]],
                 report: Callable[[str], None] = log.info, grace_s: float = GRACE_S, poll_s: float = POLL_S,
                 on_move: Callable[[tuple[int, ...]], Awaitable[None]] | None = None,
                 settling: Settling | None = None):
        self.node = node
        self.share = tuple(share)
        self.layers = list(layers)
        self.num_experts = num_experts
        self.open_node = open_node
        self.read = read
        self.report = report
        self.grace_s = grace_s
        self.poll_s = poll_s  # how often a withdrawn node's rows are looked at while it drains
        self.on_move = on_move
        self.settling = settling
        self.moves = 0

    async def serve(self, stop: asyncio.Event, interval_s: float) -> None:
        """Start the node, look every `interval_s` (0: never) and move when this member is the mover, until `stop`."""
        await self.node.start()
        try:
            while not await _wait(stop, interval_s if interval_s > 0 else None):
                try:
                    await self.step(stop)
                except Exception as error:  # a failed fetch, a DHT hiccup: the old share serves on; next round tries again
                    self.report(f"rebalancing: {one_line(error)}")
        finally:
            await self.node.stop()

    async def step(self, stop: asyncio.Event | None = None) -> Move | None:
        """One round: read the swarm, and move if this member is the one to."""
        loop = asyncio.get_running_loop()
        announcer = self.node.announcer
        if announcer is None:
            return None
        records = await loop.run_in_executor(None, self.read)
        if self.settling is None:
            self.settling = Settling(settle_s(announcer.ttl_s))
        settled = self.settling.settled(records)
        move = plan_round(records, announcer.record.address, self.share, self.layers, self.num_experts, loads=settled)
        if move is None:
            return None
        self.report(f"rebalancing: taking experts {format_ids(move.fetch)}"
                    + (f", then dropping {format_ids(move.drop)}" if move.drop else "")
                    + f" ({move.gain[0]} layer-expert pairs nobody else holds, {move.gain[1]} held by one member alone)")
        new = await loop.run_in_executor(None, self.open_node, move.share)
        try:
            await new.start()
        except BaseException:
            new.dht = None  # shared with the node serving
            await new.stop()
            raise
        old, self.node, self.share = self.node, new, move.share
        self.moves += 1
        old.dht = None
        await old.withdraw()
        self.report(f"moved: experts {format_ids(move.share)} announced as {new.announcer.record.address}; "
                    f"the old share withdrawn, closing once backbones have left it (at least {self.grace_s:g} s)")
        await self._drain(old, stop)
        await old.stop()
        if self.on_move is not None:
            await self.on_move(move.share)
        return move


    async def _drain(self, old: WorkerNode, stop: asyncio.Event | None) -> None:
        """Keep the withdrawn node answering for `grace_s`, then until it routed no row for QUIET_POLLS
        looks in a row (backbones join the new node at their own pace: a loaded one takes longer than
        the grace), for at most DRAIN_MAX_GRACES graces in all; stopping meanwhile ends it at once."""
        stop = stop or asyncio.Event()
        if await _wait(stop, self.grace_s):
            return
        served, quiet = _rows(old), 0
        for _ in range(int((DRAIN_MAX_GRACES - 1) * self.grace_s / self.poll_s)):
            if quiet >= QUIET_POLLS or await _wait(stop, self.poll_s):
                return
            now = _rows(old)
            quiet, served = (quiet + 1 if now == served else 0), now
        self.report(f"closing the old share's node: still routed to after {DRAIN_MAX_GRACES * self.grace_s:g} s")


def _rows(node: WorkerNode) -> int:
    """Rows the node's experts computed so far (worker/served.py; every answering path counts)."""
    return sum(sum(rows) for rows in node.server.store.served.totals().values())


async def _wait(stop: asyncio.Event, seconds: float | None) -> bool:
    """Whether `stop` was set within `seconds` (None: wait for it)."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except (TimeoutError, asyncio.TimeoutError):
        return False
    return True
