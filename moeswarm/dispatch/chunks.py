"""A share too large for its holder's reply bound, cut into several DISPATCHes whose RESULTs each fit.

A worker sends at most `max_result_bytes` in one RESULT (its --max-unsent-bytes, announced in its
HELLO answer; docs/protocol.md) and refuses a DISPATCH whose RESULT would be larger. A big prefill
with one worker holding every expert asks for S = T x k rows at once (2,048 tokens x top-8 at
width 2,048 in f32: 128 MiB), so the backbone cuts the share:

- exact mode: the share's experts, ascending, into runs whose rows fit (`plan_layer` with a run
  number per expert as the owner). Each expert's rows stay together and in order, so the worker
  computes every expert on exactly the rows it would have computed at once, and `combine` adds the
  same blocks: bit-identical. An expert whose rows alone do not fit cannot be cut without changing
  its computation: `ReplyTooLarge`.
- partial mode (per-token sums, not bit-identical anyway): runs of tokens.

Sizes are the worker's own arithmetic (wire/result_size.py `reply_bytes`), so a piece the backbone
sends is never one the worker refuses for its size.

Legend: T_w = tokens of the share, k = router top-k, S = routed (token, expert) pairs, n_e = rows of expert e.
"""

from __future__ import annotations

import numpy as np
import torch

from moeswarm.dispatch.plan import WorkerShare, plan_layer
from moeswarm.wire.config import CombineMode
from moeswarm.wire.result_size import reply_bytes


class ReplyTooLarge(ValueError):
    """One expert's rows alone make a RESULT over the bound: no exact cut exists."""


def cut_share(share: WorkerShare, mode: CombineMode, width: int, combine: str, num_experts: int,
              bound: int | None) -> list[WorkerShare]:
    """`share` as pieces (same worker, tokens still indexing the step) whose RESULTs fit in `bound`
    bytes; [share] when it fits already or there is no bound. width: the hidden size d;
    combine: the RESULT's codec name."""
    index = share.top_k_index.numpy()  # [T_w, k]
    if bound is None or reply_bytes(index.size, width, combine, min(index.size, num_experts)) <= bound:
        return [share]  # T_w x k rows fit (a decode step's always do): no need to count them
    if mode != CombineMode.EXACT:
        per_piece = _most_rows(lambda rows: reply_bytes(rows, width, combine, 0), bound)
        tokens = index.shape[0]
        if tokens <= per_piece:
            return [share]
        return [WorkerShare(share.worker, share.tokens[a:a + per_piece], share.top_k_index[a:a + per_piece],
                            share.top_k_weights[a:a + per_piece]) for a in range(0, tokens, per_piece)]
    size = lambda rows: reply_bytes(rows, width, combine, min(rows, num_experts))  # noqa: E731  (the worker's count)
    experts, counts = np.unique(index[index >= 0], return_counts=True)  # ascending, n_e each
    if size(int(counts.sum())) <= bound:
        return [share]
    run_of = np.full(int(experts[-1]) + 1, -1, dtype=np.int64)  # [max e + 1]: each expert's piece
    run, rows = 0, 0
    for expert, n in zip(experts.tolist(), counts.tolist()):
        if size(n) > bound:
            raise ReplyTooLarge(f"expert {expert}'s {n} rows make a RESULT of {size(n)} bytes")
        if rows and size(rows + n) > bound:
            run, rows = run + 1, 0
        run_of[expert], rows = run, rows + n
    pieces = plan_layer(torch.from_numpy(run_of), share.top_k_index, share.top_k_weights)  # pieces in run order
    return [WorkerShare(share.worker, share.tokens[piece.tokens], piece.top_k_index, piece.top_k_weights)
            for piece in pieces]


def _most_rows(size, bound: int) -> int:
    """The most rows (at least 1) whose RESULT `size(rows)` fits in `bound` (size grows with rows)."""
    low, high = 1, 1
    while size(high * 2) <= bound:
        high *= 2
    high *= 2
    while high - low > 1:  # size(low) fits (or low is 1), size(high) does not
        middle = (low + high) // 2
        low, high = (middle, high) if size(middle) <= bound else (low, middle)
    return low
