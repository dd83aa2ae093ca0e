"""The placement planner: routing statistics and workers (capacity, RTT) -> a Plan. Pure.

Legend: E = routed experts per layer, k = router top-k, W = workers, M = pseudo-rows.

Why it places as it does. A star layer call waits for the slowest worker its tokens reach
(docs/bench.md, star vs chain). The per-call chooser (placement/chooser.py `choose_for_call`)
serves each routed expert from a holder within the call's best possible slowest RTT, so a
decode token costs max over its k experts of r(e), the RTT of e's nearest holder, and

    E[layer call] = rtt_1 + sum_j (rtt_j - rtt_(j-1)) * P(a token routes to an expert whose
                                                          nearest holder is worker j or farther)

with the workers sorted by RTT. Three steps follow from it, per layer:

1. **Nearest workers first.** Moving an expert to a nearer worker never slows any token, so the
   workers are filled with one copy of each expert nearest first; the far workers keep only what
   the near ones have no room for (with equal capacities and a replica budget, the farthest
   worker holds a few unique experts and the replicas).
2. **Which experts stay far: the ones chosen rarely, and chosen together** (co-selection). The
   probabilities above are over whole top-k sets: two experts that are often chosen together
   cost one far trip between them when both are far, two when they are split. The profile keeps
   each expert's count and each pair's count, not the sets, so the planner draws M pseudo-rows
   from a pairwise model of them (each next expert of a row with probability proportional to its
   count times its co-selection lift, observed over independent, with every expert already in the
   row) and, from the farthest worker inwards, gives each worker the expert that makes the fewest
   pseudo-rows reach it or any farther worker. Experts chosen together end up together.
3. **Replicas of the hottest (EPLB's replicate step).** The budget's extra copies go, one at a
   time, to the expert with the highest count per copy, each into the free slot (on the far
   workers, after step 1) of the worker where it is most often chosen together with the experts
   that worker alone serves: a token that reaches that worker anyway is served there whole, so it
   reaches fewer workers, and the hottest experts gain a holder to fail over to.

Everything is deterministic (a fixed seed; ties broken by count, then id); `simulate.py` scores a
plan on rows (recorded or drawn the same way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moeswarm.errors import MoeSwarmError
from moeswarm.placement.plan_file import Plan, PlannedWorker, WorkerSpec

PSEUDO_ROWS = 4096  # the draw's standard error on a share of rows stays under 1 %
SEED = 0


@dataclass(frozen=True)
class LayerRouting:
    """One layer's routing statistics: rows routed, [E] counts, [E, E] pair counts (diagonal: counts)."""

    tokens: int
    counts: torch.Tensor  # [E] int64: rows that chose each expert
    pairs: torch.Tensor  # [E, E] int64: rows that chose both i and j

    @property
    def top_k(self) -> int:
        return max(1, round(int(self.counts.sum()) / max(1, self.tokens)))


def routing_from_profile(stats) -> dict[int, LayerRouting]:
    """{layer: LayerRouting} from a placement/profile.py RoutingStats (the one coupling to its format)."""
    return {int(layer): LayerRouting(int(stats.tokens[layer]), stats.counts[layer], stats.pairs[layer])
            for layer in stats.layers}


def routing_from_rows(rows: Mapping[int, torch.Tensor], num_experts: int) -> dict[int, LayerRouting]:
    """{layer: LayerRouting} counted from recorded rows {layer: [T, k] long}."""
    out = {}
    for layer, index in rows.items():
        onehot = torch.zeros(index.shape[0], num_experts, dtype=torch.long)  # [T, E]
        onehot.scatter_(1, index.long(), 1)
        out[int(layer)] = LayerRouting(index.shape[0], onehot.sum(0), onehot.T @ onehot)
    return out


def pseudo_rows(routing: LayerRouting, m: int = PSEUDO_ROWS, seed: int = SEED) -> torch.Tensor:
    """[M, k] long: rows drawn from the counts and pair counts (see the module docstring, step 2)."""
    counts, pairs = routing.counts.double(), routing.pairs.double()  # [E], [E, E]
    e, k = counts.numel(), min(routing.top_k, counts.numel())
    generator = torch.Generator().manual_seed(seed)
    independent = counts[:, None] * counts[None, :] / max(1, routing.tokens)  # [E, E]: pair count if unrelated
    lift = (pairs + 1) / (independent + 1)  # [E, E], smoothed: a pair never seen is unlikely, not impossible
    weights = (counts + 1e-6).expand(m, e).clone()  # [M, E]: never-chosen experts only when nothing else is left
    rows = torch.empty(m, k, dtype=torch.long)
    for slot in range(k):
        cdf = weights.cumsum(1)  # [M, E]
        draw = torch.rand(m, 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]  # [M, 1]
        pick = torch.searchsorted(cdf, draw).squeeze(1).clamp(max=e - 1)  # [M]: inverse-CDF draw, one per row
        rows[:, slot] = pick
        weights = weights * lift[pick]  # [M, E]
        weights.scatter_(1, pick[:, None], 0.0)
        weights = weights / weights.sum(1, keepdim=True)  # keep the products in range over k slots
    return rows


def plan_placement(routing: Mapping[int, LayerRouting], workers: Sequence[WorkerSpec], replicas: int = 0,
                   pseudo: int = PSEUDO_ROWS, seed: int = SEED) -> Plan:
    """The plan for every layer of `routing` over `workers` (capacities in experts per layer),
    with `replicas` extra copies per layer, placed for `pseudo` rows drawn per layer from `seed`.
    MoeSwarmError when the workers cannot hold it."""
    if not routing:
        raise MoeSwarmError("the routing profile has no layers")
    _check_workers(workers)
    num_experts = next(iter(routing.values())).counts.numel()
    room = sum(w.capacity for w in workers)
    if room < num_experts + replicas:
        raise MoeSwarmError(f"the workers hold {room} experts per layer in all: not enough for {num_experts} experts "
                            f"and {replicas} replicas (raise capacities or lower --replicas)")
    held: list[dict[int, tuple[int, ...]]] = [{} for _ in workers]
    for layer, stats in sorted(routing.items()):
        if stats.counts.numel() != num_experts:
            raise MoeSwarmError(f"layer {layer} has {stats.counts.numel()} experts, layer {min(routing)} {num_experts}")
        if stats.tokens == 0:
            raise MoeSwarmError(f"the routing profile counted no rows for layer {layer}")
        for index, experts in plan_layer(stats, workers, replicas, pseudo_rows(stats, pseudo, seed + layer)).items():
            if experts:
                held[index][layer] = experts
    return Plan(num_experts, replicas, tuple(PlannedWorker(w, h) for w, h in zip(workers, held)))


def plan_layer(routing: LayerRouting, workers: Sequence[WorkerSpec], replicas: int,
               rows: torch.Tensor) -> dict[int, tuple[int, ...]]:
    """{worker index: experts, ascending} for one layer; rows [M, k]: the rows to place for."""
    e = routing.counts.numel()
    order = sorted(range(len(workers)), key=lambda i: (workers[i].rtt_ms, workers[i].name))  # nearest first
    unique, left = {}, e
    for i in order:  # step 1: one copy of each expert, nearest workers filled first
        unique[i] = min(workers[i].capacity, left)
        left -= unique[i]
    onehot = torch.zeros(rows.shape[0], e)  # [M, E] 0/1 (float: counting is a matrix product)
    onehot.scatter_(1, rows, 1.0)
    primary = _far_first(onehot, routing.counts, [(i, unique[i]) for i in order])
    held = {i: set(experts) for i, experts in primary.items()}
    _replicate(onehot, routing.counts, primary, held, workers, order, replicas)
    return {i: tuple(sorted(held[i])) for i in range(len(workers))}


def _far_first(onehot: torch.Tensor, counts: torch.Tensor, sizes: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Step 2: {worker: the experts it is the nearest holder of}. onehot [M, E] 0/1; sizes:
    (worker, how many) nearest first; the nearest takes what the farther ones leave."""
    remaining = set(range(onehot.shape[1]))
    untouched = torch.ones(onehot.shape[0])  # [M]: 1 for a row that reaches no worker placed so far
    count = counts.tolist()
    out: dict[int, list[int]] = {}
    for worker, size in reversed(sizes[1:]):
        chosen = []
        for _ in range(size):
            newly = (untouched @ onehot).tolist()  # [E]: rows each expert would add
            expert = min(remaining, key=lambda x: (newly[x], count[x], x))
            chosen.append(expert)
            remaining.discard(expert)
            untouched = untouched * (1 - onehot[:, expert])
        out[worker] = chosen
    out[sizes[0][0]] = sorted(remaining)
    return out


def _replicate(onehot: torch.Tensor, counts: torch.Tensor, primary: dict[int, list[int]], held: dict[int, set[int]],
               workers: Sequence[WorkerSpec], order: list[int], replicas: int) -> None:
    """Step 3: add `replicas` copies to `held`, hottest per copy first."""
    copies, count = {x: 1 for x in range(onehot.shape[1])}, counts.tolist()
    reach = {i: onehot[:, primary[i]].amax(1) if primary[i] else torch.zeros(onehot.shape[0])
             for i in held}  # [M] per worker: 1 for a row that must reach it
    for _ in range(replicas):
        free = [i for i in order if len(held[i]) < workers[i].capacity]
        for expert in sorted(copies, key=lambda x: (-count[x] / copies[x], x)):
            places = [i for i in free if expert not in held[i]]
            if places:
                break
        else:
            raise MoeSwarmError(f"no room for {replicas} replicas: every worker with a free slot already holds "
                                f"the experts left to copy")
        together = {i: float(reach[i] @ onehot[:, expert]) for i in places}
        worker = max(places, key=lambda i: (together[i], -workers[i].rtt_ms, -order.index(i)))
        held[worker].add(expert)
        copies[expert] += 1


def contiguous_plan(num_experts: int, layers: Sequence[int], workers: Sequence[WorkerSpec]) -> Plan:
    """The naive split: the experts cut into len(workers) contiguous, even runs, in the workers'
    order, the same for every layer (what `moeswarm worker --experts A-B` per worker gives)."""
    _check_workers(workers)
    if len(workers) > num_experts:
        raise MoeSwarmError(f"cannot split {num_experts} experts over {len(workers)} workers")
    bounds = [round(i * num_experts / len(workers)) for i in range(len(workers) + 1)]
    return Plan(num_experts, 0, tuple(
        PlannedWorker(w, {layer: tuple(range(bounds[i], bounds[i + 1])) for layer in layers})
        for i, w in enumerate(workers)))


def _check_workers(workers: Sequence[WorkerSpec]) -> None:
    if not workers:
        raise MoeSwarmError("no workers to place experts on")
    names = [w.name for w in workers]
    if len(set(names)) != len(names):
        raise MoeSwarmError(f"worker names must be distinct, got {', '.join(names)}")


__all__ = ["LayerRouting", "Plan", "contiguous_plan", "plan_placement", "pseudo_rows",
           "routing_from_profile", "routing_from_rows"]
