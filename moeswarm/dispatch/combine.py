"""Adding the experts' outputs back into one hidden state per token.

Legend: T = tokens, d = hidden size, n_e = rows routed to expert e.
"""

from __future__ import annotations

import numpy as np
import torch


def combine_exact(hidden: torch.Tensor, top_k_index: torch.Tensor, per_expert: dict[int, torch.Tensor],
                  sums: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """Eager's sum, bit for bit: experts in ascending order, each added with `index_add_`.

    hidden        [T, d] the layer's input (for shape and dtype)
    top_k_index   [T, k] the router's experts
    per_expert    {e: [n_e, d]} w * E_e(x) for e's rows in eager order (slot-major, then token)
    sums          [(tokens [T_w], [T_w, d])]: tokens whose experts one holder added up itself, in the
                  same order from zero (dispatch/flight.py `request`); per_expert has none of their rows

    A decode step's single row takes the same adds without finding each expert's tokens: its value
    is (((0 + c_e1) + c_e2) + ...) over its experts' rows in ascending order.

    In float32 the adds are numpy's (IEEE single, as torch's; a token once per add): torch's
    `index_add_` opens an OpenMP region with 2 or more threads, 30-100 us per call when the pool's
    threads sleep between calls (OMP_WAIT_POLICY=PASSIVE), more than the adds themselves: 16 rows
    over 64 experts of 2048 took 2.4 ms per layer that way, 0.25 ms in numpy.
    """
    if sums:
        covered = torch.cat([tokens for tokens, _ in sums])  # [T_s]
        if per_expert:
            top_k_index = top_k_index.clone()
            top_k_index[covered] = -1  # those tokens' rows came summed
        final = combine_exact(hidden, top_k_index, per_expert) if per_expert else torch.zeros_like(hidden)
        for tokens, total in sums:  # a token is in one sum at most, and none of its rows came per expert
            total = total.to(final.dtype)
            if final.dtype == torch.float32:
                rows = final.numpy()  # [T, d], a view of `final`
                rows[tokens.numpy()] += total.numpy()  # 0 + sum: the sum's bits
            else:
                final.index_add_(0, tokens, total)
        return final
    final = torch.zeros_like(hidden)  # [T, d]
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
    for expert in sorted(per_expert):
        _, token = torch.where(top_k_index.T == expert)  # [n_e], distinct when no row repeats an expert
        if rows is not None:
            rows[token.numpy()] += per_expert[expert].to(torch.float32).numpy()
        else:
            final.index_add_(0, token, per_expert[expert].to(final.dtype))
    return final


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
