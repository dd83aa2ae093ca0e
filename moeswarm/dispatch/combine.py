"""Adding the experts' outputs back into one hidden state per token.

Legend: T = tokens, d = hidden size, n_e = rows routed to expert e.
"""

from __future__ import annotations

import numpy as np
import torch

from moeswarm.kernels.qkernels import add_rows

# Up to this many tokens the adds go by rank (`_add_by_rank`: k vectorized rounds); above, one
# indexing pass per expert reads less memory (it copies no outputs). Where they cross:
# docs/measured.md, "combine".
RANK_ADD_TOKENS = 128


def combine_exact(hidden: torch.Tensor, top_k_index: torch.Tensor, per_expert: dict[int, torch.Tensor],
                  sums: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """Eager's sum, bit for bit: experts in ascending order, each added with `index_add_`.

    hidden        [T, d] the layer's input (for shape and dtype)
    top_k_index   [T, k] the router's experts
    per_expert    {e: [n_e, d]} w * E_e(x) for e's rows in eager order (slot-major, then token)
    sums          [(tokens [T_w], [T_w, d])]: per token, the sum one holder made from zero of its
                  first experts (every other expert of the token has a higher id; all of them, where
                  it held them all), in the same order (dispatch/flight.py `request`). per_expert
                  has none of those experts' rows: each expert's rows come from one holder, so the
                  token's sum goes on from there with the rows of its later experts.

    A decode step's single row takes the same adds without finding each expert's tokens: its value
    is (((0 + c_e1) + c_e2) + ...) over its experts' rows in ascending order.

    In float32 the adds are numpy's (IEEE single, as torch's; a token once per add): torch's
    `index_add_` opens an OpenMP region with 2 or more threads, which costs more than the adds
    themselves when the pool's threads sleep between calls (OMP_WAIT_POLICY=PASSIVE;
    docs/measured.md, "combine").
    """
    if hidden.dtype == torch.float32 and len(sums) == 1 and sums[0][0].shape[0] == hidden.shape[0]:
        # One holder summed every token (its tokens are distinct and ascending: all of them): 0 + sum
        # is the sum's bits but for -0.0, which becomes +0.0 (x + 0.0 is that, in one numpy call).
        final = torch.from_numpy(sums[0][1].to(torch.float32).numpy() + np.float32(0.0))  # [T, d], a new array
        sums = ()
    else:
        final = torch.zeros_like(hidden)  # [T, d]
    for tokens, total in sums:  # a token is in one sum at most: the one of its lowest experts
        total = total.to(final.dtype)
        if final.dtype == torch.float32:
            final.numpy()[tokens.numpy()] += total.numpy()  # 0 + sum: the sum's bits
        else:
            final.index_add_(0, tokens, total)
    if not per_expert:
        return final
    if hidden.shape[0] == 1:
        if final.dtype == torch.float32:  # numpy's adds: IEEE single, as torch's, at a tenth of the call cost
            total = final.numpy()[0]  # [d], a view of `final`
            for expert in sorted(per_expert):
                for row in per_expert[expert].to(torch.float32).numpy():  # one row, or more where a router repeats
                    np.add(total, row, out=total)
            return final
        for expert in sorted(per_expert):
            for row in per_expert[expert].to(final.dtype):
                final += row
        return final
    rows = final.numpy() if final.dtype == torch.float32 and not _repeats(top_k_index) else None  # [T, d] view
    if rows is not None and hidden.shape[0] <= RANK_ADD_TOKENS:
        _add_by_rank(rows, top_k_index.numpy(), per_expert)
        return final
    for expert in sorted(per_expert):
        _, token = torch.where(top_k_index.T == expert)  # [n_e], distinct when no row repeats an expert
        if rows is not None:
            rows[token.numpy()] += per_expert[expert].to(torch.float32).numpy()
        else:
            final.index_add_(0, token, per_expert[expert].to(final.dtype))
    return final


def combine_token(hidden: torch.Tensor, sums: list[tuple[torch.Tensor, torch.Tensor]],
                  exact: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor | None:
    """`combine_exact` of a decode step's one float32 token, from the exact holders' RESULTs as they
    came: each holder's rows [n, d], its experts ascending (n_e rows each, in order), go into the
    token in one C call (qkernels.add_rows), where `combine_exact` adds them one numpy call per row.
    hidden [1, d]; sums as for `combine_exact` (the token's lowest experts' sum, if one holder made
    it); exact [(experts, rows)]. The same adds in the same order: None when two holders' experts
    interleave (then only `combine_exact`'s per-expert order is right)."""
    exact = sorted(exact, key=lambda answer: answer[0][0])
    if any(a[-1] >= b[0] for (a, _), (b, _) in zip(exact, exact[1:])) or \
            any(rows.dtype != torch.float32 for _, rows in exact):
        return None
    final = combine_exact(hidden, None, {}, sums)  # [1, d]: +0.0, or the lowest experts' sum
    total = final.numpy()[0]  # [d], a view of `final`
    for _, rows in exact:
        add_rows(total, rows.numpy())
    return final


def _add_by_rank(final: np.ndarray, top_k_index: np.ndarray, per_expert: dict[int, torch.Tensor]) -> None:
    """Eager's adds for many tokens at once: round j adds every token's j-th expert (ascending) to it.

    final [T, d] float32, added into: zeros, or a holder's sums of its first experts; top_k_index
    [T, k] with no expert twice in a row (slots of experts absent from per_expert are skipped:
    they came summed). Each token still gets (((s + c_e1) + c_e2) + ...) over its experts
    ascending, the same IEEE single adds as one expert at a time, in k vectorized rounds instead of
    one indexing pass per expert. A token with fewer rows than the round gets +0.0, which leaves
    its accumulator unchanged: it started at +0.0 here or on the holder that summed, so it is never
    -0.0 (x + y is -0.0 only when both are).
    """
    experts = sorted(per_expert)
    tokens, k = top_k_index.shape
    outputs = np.concatenate([per_expert[e].to(torch.float32).numpy() for e in experts]
                             + [np.zeros((1, final.shape[1]), np.float32)])  # [S + 1, d]: experts ascending, then a zero row
    # Row r of `outputs` is pair r in (expert ascending, slot, token) order: the order of each
    # expert's block (slot-major, then token).
    flat = top_k_index.T.reshape(-1)  # [k * T]: position slot * T + token
    wanted = np.isin(flat, experts)
    positions = np.flatnonzero(wanted)
    order = positions[np.argsort(flat[positions], kind="stable")]  # [S]: the pairs in row order
    owner = order % tokens  # [S]: each row's token
    by_token = np.argsort(owner, kind="stable")  # rows grouped by token, ascending expert within
    counts = np.bincount(owner, minlength=tokens)  # [T]
    ranks = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)  # each grouped row's rank
    table = np.full((tokens, k), len(owner), dtype=np.int64)  # [T, k]: row of each token's j-th expert (zero row: none)
    table[owner[by_token], ranks] = by_token
    for j in range(int(counts.max(initial=0))):
        final += outputs[table[:, j]]


def _repeats(top_k_index: torch.Tensor) -> bool:
    """Whether a row lists an expert twice (DeepSeek-V4's hash-routed layers may): then an expert's
    rows name a token twice, and only `index_add_` adds both in order."""
    ordered = np.sort(top_k_index.numpy(), axis=1)  # [T, k]
    return bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())


def combine_partial(hidden: torch.Tensor, partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum the workers' per-token partial sums.

    partials  [(tokens [T_w], sums [T_w, d])], one per worker, in worker order
    """
    final = torch.zeros_like(hidden)  # [T, d]
    for tokens, sums in partials:
        final.index_add_(0, tokens, sums.to(final.dtype))
    return final
