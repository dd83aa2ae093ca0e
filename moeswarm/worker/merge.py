"""Merging DISPATCHes of one layer from several backbones into one expert call, and splitting the answer.

Legend: R = merged requests, T_r = tokens of request r, T = sum of T_r, k = top-k, d = hidden size.

Which requests merge (`partners`): those of the same layer, combine mode, top-k and dtypes whose
expert sets are disjoint. Why disjoint: a CPU matmul may give a row other low-order bits
depending on how many rows it runs with (measured with torch 2.13 on this project's CPU: with
K = 128 a row computed among 1-5 rows differs from the same row among more; docs/federation.md),
and the eager experts run one matmul per expert over that expert's rows. With disjoint expert
sets each expert still sees exactly one request's rows, in that request's eager order (slot-major,
then token: concatenating along tokens keeps each request's order), so every output row, and in
partial mode every per-token sum (only that request's experts add into its tokens, ascending), is
bit-identical to the unmerged call. What a merged call saves is the per-call work around the
experts: one pass of the store instead of R.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moeswarm.wire.config import COMBINE_MODES, CombineMode
from moeswarm.wire.messages import Dispatch, Result


@dataclass(frozen=True)
class MergePlan:
    """How a merged Result goes back to its requests: each one's tokens and, per request, what it was."""

    requests: tuple[Dispatch, ...]
    starts: tuple[int, ...]  # first merged token of each request: request r holds tokens [starts[r], starts[r] + T_r)


def merge_key(meta: dict[str, Any]) -> Hashable | None:
    """What a DISPATCH must share with others to be merged, read from its metadata before decoding
    (None: never merged). Decoding checks the metadata properly; this only sorts candidates."""
    layer, mode = meta.get("layer"), meta.get("mode")
    if not isinstance(layer, int) or isinstance(layer, bool) or mode not in COMBINE_MODES:
        return None
    return layer, mode


def experts_of(request: Dispatch) -> frozenset[int]:
    """The experts `request` routes any token to (ids >= 0)."""
    index = request.top_k_index  # [T_r, k]
    return frozenset(torch.unique(index[index >= 0]).tolist())


def partners(requests: Sequence[Dispatch]) -> list[int]:
    """Positions of the requests that may run in one call with requests[0] (0 first), greedily in
    order: same layer, mode, k, width and dtypes, and pairwise disjoint expert sets."""
    def kind(request: Dispatch) -> tuple:
        return (request.layer, request.mode, request.top_k_index.shape[1], request.hidden.shape[1],
                request.hidden.dtype, request.top_k_weights.dtype)

    lead = kind(requests[0])
    taken, chosen = set(experts_of(requests[0])), [0]
    for position in range(1, len(requests)):
        experts = experts_of(requests[position])
        if kind(requests[position]) == lead and not taken & experts:
            taken |= experts
            chosen.append(position)
    return chosen


def merge(requests: Sequence[Dispatch]) -> tuple[Dispatch, MergePlan]:
    """One Dispatch holding every request's tokens, in order, and the plan to split its Result.

    requests: requests chosen by `partners` (ValueError when two share an expert: the bits would change).
    """
    taken: set[int] = set()
    for request in requests:
        experts = experts_of(request)
        if taken & experts:
            raise ValueError(f"requests share experts {sorted(taken & experts)}: merging them would change bits")
        taken |= experts
    first = requests[0]
    starts, total = [], 0
    for request in requests:
        starts.append(total)
        total += request.hidden.shape[0]
    merged = Dispatch(first.layer,
                      torch.cat([r.hidden for r in requests]),  # [T, d]
                      torch.cat([r.top_k_index for r in requests]),  # [T, k]
                      torch.cat([r.top_k_weights for r in requests]),  # [T, k]
                      first.mode, first.wire_dispatch, first.wire_combine)
    return merged, MergePlan(tuple(requests), tuple(starts))


def split(result: Result, plan: MergePlan) -> list[Result]:
    """Each request's own Result, as its unmerged call would have answered it (bit for bit).

    exact:   the merged outputs' row blocks go to the request that routed to their expert
             (experts stay ascending within each request);
    partial: request r takes rows [starts[r], starts[r] + T_r) of the merged [T, d].
    """
    counts = dict(zip(result.experts, result.counts))  # expert -> n_e
    answers = []
    if result.mode == CombineMode.PARTIAL:  # per-token sums
        for request, start in zip(plan.requests, plan.starts):
            experts = sorted(experts_of(request))
            rows = result.outputs[start : start + request.hidden.shape[0]]  # [T_r, d]
            answers.append(Result(result.layer, result.mode, rows, experts, [counts[e] for e in experts],
                                  request.wire_combine))
        return answers
    blocks = dict(zip(result.experts, torch.split(result.outputs, result.counts)))  # expert -> [n_e, d]
    for request in plan.requests:
        experts = sorted(experts_of(request))
        outputs = torch.cat([blocks[e] for e in experts])  # [sum n_e, d], experts ascending
        answers.append(Result(result.layer, result.mode, outputs, experts, [counts[e] for e in experts],
                              request.wire_combine))
    return answers
