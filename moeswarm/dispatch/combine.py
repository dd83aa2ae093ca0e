"""Adding the experts' outputs back into one hidden state per token.

Legend: T = tokens, d = hidden size, n_e = rows routed to expert e.
"""

from __future__ import annotations

import numpy as np
import torch


LAID_OUT_TOKENS = 64


def combine_exact(hidden: torch.Tensor, top_k_index: torch.Tensor, per_expert: dict[int, torch.Tensor]) -> torch.Tensor:
    """Eager's sum, bit for bit: experts in ascending order, each added with `index_add_`.

    hidden        [T, d] the layer's input (for shape and dtype)
    top_k_index   [T, k] the router's experts
    per_expert    {e: [n_e, d]} w * E_e(x) for e's rows in eager order (slot-major, then token)

    Each token's value is (((0 + c_e1) + c_e2) + ...) over its experts e1 < e2 < ..., which is what
    eager's per-expert `index_add_` into zeros computes. The sums are taken that way for every token
    at once: the contributions laid out [T, 1 + k, d] (a zero first, then each token's experts in
    ascending order, zeros after: x + 0 == x for every x such a sum can reach, as it starts from +0)
    and added slot after slot: k adds of [T, d] whatever the number of experts, where eager's order
    by expert takes one `index_add_` per expert. Past LAID_OUT_TOKENS tokens (prefill) the layout
    would be large and the per-call cost does not matter: eager's own loop.
    """
    T, d = hidden.shape
    if not per_expert or T > LAID_OUT_TOKENS:
        final = torch.zeros_like(hidden)  # [T, d]
        for expert in sorted(per_expert):
            _, token = torch.where(top_k_index.T == expert)  # [n_e]
            final.index_add_(0, token, per_expert[expert].to(final.dtype))
        return final
    experts = sorted(per_expert)
    if T == 1:  # a decode step's row: each expert's rows (one, or more where a router repeats an expert) in turn
        final = torch.zeros_like(hidden)  # [1, d]
        for expert in experts:
            for row in per_expert[expert].to(hidden.dtype):
                final += row
        return final
    index = top_k_index.numpy()  # [T, k]
    rows = torch.cat([per_expert[e] for e in experts]).to(hidden.dtype)  # [S, d]: experts ascending, eager's order within
    # Each row's token: for each expert ascending, its (slot, token) pairs slot-major then token.
    token_of = np.concatenate([np.nonzero(index.T == e)[1] for e in experts])  # [S]
    if len(token_of) != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} expert output rows for {len(token_of)} routed (token, expert) pairs")
    # Where each row goes in [T, 1 + k]: after its token's rows of smaller experts (a stable sort by token
    # keeps the experts ascending within a token).
    order = np.argsort(token_of, kind="stable")  # [S]
    tokens_sorted = token_of[order]
    first = np.searchsorted(tokens_sorted, tokens_sorted, side="left")  # [S] where each token's run starts
    place = np.empty_like(order)
    place[order] = np.arange(len(order)) - first + 1  # 1 + rank among its token's rows
    width = int(place.max()) + 1 if len(place) else 1
    laid = torch.zeros(T, width, d, dtype=hidden.dtype)  # [T, 1 + n, d]
    laid[torch.from_numpy(token_of), torch.from_numpy(place)] = rows
    final = laid[:, 0].clone()  # [T, d] zeros
    for slot in range(1, width):
        final += laid[:, slot]
    return final


def combine_partial(hidden: torch.Tensor, partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum the workers' per-token partial sums.

    partials  [(tokens [T_w], sums [T_w, d])], one per worker, in worker order
    """
    final = torch.zeros_like(hidden)  # [T, d]
    for tokens, sums in partials:
        final.index_add_(0, tokens, sums.to(final.dtype))
    return final
