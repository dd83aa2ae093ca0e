"""The churn of `moeswarm bench swarm`: K times a random joiner is killed (SIGKILL: no withdrawal;
its record expires after the TTL) and started again in the same --dir, while the stream runs.

The rejoin starts after the killed record expired (`--rejoin expiry`: the rejoiner sees the hole it
left) or at once (`--rejoin now`: as a supervisor restarts a process; with a TTL longer than a start
takes, it sees its own stale record and chooses around it, and rebalancing repairs what that
unbalances). A row per kill: the coverage the DHT shows once the killed record is gone, the rejoin's
figures, the seconds until the coverage is back to what it was before the kill, the seconds until
the stream's first layer call answered by the rejoiner, the stream's tokens/s and longest pause over
the event, and the rebalancing moves made meanwhile."""

from __future__ import annotations

import random
import time

from moeswarm.errors import MoeSwarmError
from moeswarm_bench.bench.swarm_coverage import Coverage, Snapshot, alive_fewest
from moeswarm_bench.bench.swarm_joins import join_row
from moeswarm_bench.bench.swarm_procs import Joiner
from moeswarm_bench.bench.swarm_settings import Settings
from moeswarm_bench.bench.swarm_stream import Stream
from moeswarm_bench.bench.swarm_windows import stream_window

PAUSE_TOKENS = 16  # between one event's end and the next kill
SETTLE_S = 120.0  # the most a kill's coverage is waited for to come back


def churn(joiners: list[Joiner], view: Coverage, stream: Stream, initial: Snapshot, settings: Settings,
          rng: random.Random, expert_bytes: int, say) -> tuple[list[dict], list[tuple[float, float]]]:
    """K kills, each followed by a rejoin: a row per kill, and each one's (kill, coverage back) times."""
    rows, spans = [], []
    for k in range(settings.kills):
        victim = rng.choice(joiners)
        address = victim.address_now()
        moves_before = sum(len(j.moves()) for j in joiners)
        killed_at = victim.life.kill()
        say(f"  kill {k + 1}: {victim.name} ({address}) killed")
        if settings.rejoin == "now":
            victim.start()
        dropped = view.wait(lambda c: address not in c.members, 3 * settings.ttl_s + 60.0)
        if settings.rejoin != "now":
            victim.start()
        figures = victim.serving()
        rejoin = join_row(victim, figures, None, expert_bytes)
        settle_deadline = time.monotonic() + SETTLE_S
        try:
            restored = view.wait(lambda c: c.fewest >= initial.fewest and victim.address_now() in c.members
                                 and len(c.members) >= len(joiners), SETTLE_S)
        except MoeSwarmError:
            restored = None
        first_use = wait_first_use(stream, victim, max(5.0, settle_deadline - time.monotonic()))
        ended = restored.at if restored is not None else time.monotonic()
        row = {"kill": k + 1, "joiner": victim.name, "address": address,
               "dropped_s": dropped.at - killed_at, "after_kill": dropped.to_json(),
               "alive_fewest_after_kill": alive_fewest(joiners, killed_at + 1e-6, view.num_experts),
               "rejoin": rejoin, "rejoin_announced_after_kill_s": figures.announced_at - killed_at,
               "first_use_after_announce_s": None if first_use is None else first_use - figures.announced_at,
               "restored": restored is not None,
               "restored_s": None if restored is None else restored.at - killed_at,
               "after_rejoin": (restored or view.read()).to_json(),
               "moves": sum(len(j.moves()) for j in joiners) - moves_before,
               **stream_window(stream.figures.tokens, killed_at, ended)}
        rows.append(row)
        spans.append((killed_at, ended))
        say(f"  kill {k + 1}: record gone after {row['dropped_s']:.1f} s (fewest holders {dropped.fewest}), "
            f"{victim.name} serving again {row['rejoin_announced_after_kill_s']:.1f} s after the kill"
            + ("" if restored is None else f", coverage back after {row['restored_s']:.1f} s"))
        stream.wait_tokens(PAUSE_TOKENS)
    return rows, spans


def wait_first_use(stream: Stream, joiner: Joiner, wait_s: float) -> float | None:
    """When the stream's first layer call answered by `joiner`'s current address came (None: not within `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        address = joiner.address_now()
        if address in stream.figures.first_used:
            return stream.figures.first_used[address]
        time.sleep(0.05)
    return None
