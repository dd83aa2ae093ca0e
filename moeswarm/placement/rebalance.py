"""Rebalancing a member's share (`moeswarm join --rebalance`): which experts to fetch and which to drop.

Pure functions over plain data; the member loop (node/rebalancing.py) reads the coverage
from the DHT every period, calls `choose_mover`, and only the member it names acts on its `Move`:
fetch the new experts, announce the new share, then drop the old part.

    coverage[l][e]  holders of expert e at MoE layer l, this member included   (share.coverage_of)
    without         the same with this member's own share taken out
    gain(e)         what holding e adds to `without`  (share.gain: cells covered, cells given a
                    second holder, then load relief)

A move keeps the share's size (plus free slots, up to `capacity`) and swaps held experts for
unheld ones. Gains are sums of independent terms, so the best share reachable with at most k swaps
takes the k best unheld experts and gives up the k worst held ones, pair by pair while a pair
gains. The rules that make it safe and damped:

- **never uncover**: an expert this member is the only holder of at any layer is never dropped
  (`droppable`: others hold it at every layer); what it drops, others still serve.
- **margin**: a swap of held y for unheld x is made only when x covers more cells nobody else
  holds than y, or as many and gives more cells a second holder, or both as many and its relief
  passes y's by the factor (1 + margin): small gains do not move bytes.
- **redundancy before load**: a cell one member alone holds is one departure from a stall, so
  giving it a second holder outranks any load relief, and a move never takes a cell's second
  holder away to relieve a hot one.
- **one mover a round**: every member evaluates every member's best move on the same coverage;
  only the one whose move gains most (ties: the smallest member id) moves. A move strictly lowers
  (uncovered cells, cells held once, load per holder summed over cells), so rounds end.
- **the swarm gains by a margin** (Petals' rule): a move that neither covers a new cell nor gives
  one a second holder is made only when
  it removes at least `swarm_margin` of the swarm's load per holder summed over its held cells
  (`cost`). Measured loads are noisy (rows per minute over a short window), and with many experts
  some pair always passes the per-swap margin by chance; a move costs the share's bytes, so only
  a gain to the whole swarm moves them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from moeswarm.placement.share import Coverage, Gain, gain

MARGIN = Fraction(1, 4)
SWARM_MARGIN = Fraction(1, 10)


@dataclass(frozen=True)
class Move:
    """A member's rebalancing step: fetch `fetch`, announce `share`, then drop `drop` (all ascending)."""

    fetch: tuple[int, ...]
    drop: tuple[int, ...]
    share: tuple[int, ...]  # the share after the move
    gain: Gain  # (cells newly covered, cells given a second holder, load per holder removed), over the swaps and additions


def without(coverage: Coverage, share: Sequence[int]) -> dict[int, list[int]]:
    """`coverage` with one member holding `share` at every layer taken out."""
    held = set(share)
    return {layer: [h - (e in held) for e, h in enumerate(holders)] for layer, holders in coverage.items()}


def droppable(coverage: Coverage, share: Sequence[int]) -> list[int]:
    """The experts of `share` that another member holds at every layer (dropping them uncovers nothing)."""
    return [e for e in share if all(holders[e] >= 2 for holders in coverage.values())]


def rebalance(coverage: Coverage, share: Sequence[int], capacity: int, load: Coverage | None = None,
              margin: Fraction = MARGIN, max_swaps: int | None = None) -> Move | None:
    """This member's best move (see the module's docstring), or None when no swap or addition gains.

    coverage: holders per expert of every MoE layer, this member's `share` (held at every layer)
    counted. capacity: the experts its memory holds (a share never shrinks below its size).
    load: as share.choose_share's (None: 1 everywhere). max_swaps: None for no bound."""
    others = without(coverage, share)
    held = set(share)
    gains = {e: gain(others, e, load) for e in range(len(next(iter(coverage.values()))))}
    wanted = sorted((e for e in gains if e not in held and _positive(gains[e])), key=lambda e: (_key(gains[e]), e))
    free = max(0, min(capacity, len(gains)) - len(share))
    fetch = wanted[:free]
    wanted = wanted[free:]
    spare = sorted(droppable(coverage, share), key=lambda e: (_key(gains[e]), -e), reverse=True)  # worst first
    drop = []
    for x, y in zip(wanted, spare):
        if max_swaps is not None and len(drop) >= max_swaps or not _better(gains[x], gains[y], margin):
            break
        fetch.append(x)
        drop.append(y)
    if not fetch:
        return None
    total = tuple(sum((gains[e][i] for e in fetch), start) - sum((gains[e][i] for e in drop), start)
                  for i, start in enumerate((0, 0, Fraction(0))))
    return Move(tuple(sorted(fetch)), tuple(sorted(drop)), tuple(sorted(held - set(drop) | set(fetch))), total)


def choose_mover(coverage: Coverage, shares: Mapping[str, Sequence[int]], capacities: Mapping[str, int] | None = None,
                 load: Coverage | None = None, margin: Fraction = MARGIN,
                 swarm_margin: Fraction = SWARM_MARGIN) -> tuple[str, Move] | None:
    """(the member that moves this round, its move), or None when no member's move gains enough.

    shares: {member id: experts it holds at every layer} of the members that may move (counted in
    `coverage` too, with any others). capacities: {member id: experts its memory holds} (absent:
    its share's size). A best move that covers no new cell and gives none a second holder must
    remove at least `swarm_margin` of `cost(coverage, load)`."""
    best = None
    for member in sorted(shares):
        capacity = (capacities or {}).get(member, len(shares[member]))
        move = rebalance(coverage, shares[member], capacity, load, margin)
        if move is not None and (best is None or _key(move.gain) < _key(best[1].gain)):
            best = (member, move)
    if best is not None and best[1].gain[0] <= 0 and best[1].gain[1] <= 0 and \
            best[1].gain[2] < swarm_margin * cost(coverage, load):
        return None
    return best


def cost(coverage: Coverage, load: Coverage | None = None) -> Fraction:
    """The swarm's load per holder summed over its held cells: sum of load[l][e] / holders[l][e]
    (load None: 1 everywhere). A move's relief (`Move.gain[2]`) is how much it lowers this."""
    return sum((Fraction(1 if load is None else load[layer][e], h)
                for layer, holders in coverage.items() for e, h in enumerate(holders) if h > 0), Fraction(0))


def _positive(value: Gain) -> bool:
    return any(part > 0 for part in value)


def _key(value: Gain) -> tuple[int, int, Fraction]:
    """Sort key putting the largest gain first."""
    return -value[0], -value[1], -value[2]


def _better(x: Gain, y: Gain, margin: Fraction) -> bool:
    """Whether holding an expert of gain `x` instead of one of gain `y` is worth a move."""
    if x[:2] != y[:2]:
        return x[:2] > y[:2]
    return x[2] > (1 + margin) * y[2]
