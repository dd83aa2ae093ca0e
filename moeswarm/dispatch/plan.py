"""Who gets which rows: a pure function of the routing and the expert placement.

Legend: T = tokens in the step, k = router top-k, E = routed experts, W = workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NOT_PLANNED = -2  # slot_owner of a slot marked -1 in the routing: belongs to no share here
# [1]: a one-token step's tokens, one tensor shared by every call (never written): a torch call saved per call
_ONLY_TOKEN = torch.zeros(1, dtype=torch.long)


@dataclass(frozen=True)
class WorkerShare:
    """The part of one MoE layer's step that goes to one worker.

    tokens         [T_w] long, indices into the step's tokens (ascending)
    top_k_index    [T_w, k] long, the router's experts; -1 where another worker holds the expert
    top_k_weights  [T_w, k] the router's weights for those tokens
    """

    worker: int
    tokens: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor


def plan_layer(owner: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> list[WorkerShare]:
    """Split a layer's routing by worker.

    owner          [E] long, the worker holding each expert (-1: nobody)
    top_k_index    [T, k] long; -1 marks a slot that is not to be planned (another share's)
    top_k_weights  [T, k]

    The bookkeeping runs in numpy: a decode step's layer is one row, where each torch op on it costs
    more than its work; one row, the decode step of one sequence, in plain Python, cheaper still
    (docs/measured.md, "plan").
    """
    index = top_k_index.numpy()  # [T, k] int64
    if index.shape[0] == 1:
        return _plan_row(owner.numpy(), index[0].tolist(), top_k_index, top_k_weights)
    routed = index >= 0  # [T, k]
    slot_owner = np.where(routed, owner.numpy()[np.maximum(index, 0)], NOT_PLANNED)  # [T, k]
    if (slot_owner == -1).any():
        missing = sorted(set(index[slot_owner == -1].tolist()))
        raise LookupError(f"no worker holds experts {missing}")
    workers = np.unique(slot_owner[routed])  # ascending
    if len(workers) == 1 and routed.all():  # every slot to one holder: the whole routing, no copy
        tokens = torch.arange(index.shape[0])
        return [WorkerShare(int(workers[0]), tokens, top_k_index, top_k_weights)]
    shares = []
    for worker in workers.tolist():
        mine = slot_owner == worker  # [T, k]
        tokens = np.flatnonzero(mine.any(axis=1))  # [T_w]
        share_index = np.where(mine, index, -1)[tokens]  # [T_w, k]
        shares.append(WorkerShare(worker, torch.from_numpy(tokens), torch.from_numpy(share_index),
                                  top_k_weights[torch.from_numpy(tokens)]))
    return shares


def _plan_row(owner: np.ndarray, row: list[int], top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> list[WorkerShare]:
    """plan_layer of one token: owner [E], row its k expert ids (-1: not planned here)."""
    slot_owner = [int(owner[e]) if e >= 0 else NOT_PLANNED for e in row]  # [k]
    if -1 in slot_owner:
        raise LookupError(f"no worker holds experts {sorted({e for e, o in zip(row, slot_owner) if o == -1})}")
    workers = sorted(set(slot_owner) - {NOT_PLANNED})
    token = _ONLY_TOKEN
    if len(workers) == 1 and NOT_PLANNED not in slot_owner:
        return [WorkerShare(workers[0], token, top_k_index, top_k_weights)]
    return [WorkerShare(worker, token, torch.tensor([[e if o == worker else -1 for e, o in zip(row, slot_owner)]]),
                        top_k_weights) for worker in workers]


def replan_share(share: WorkerShare, owner: torch.Tensor) -> list[WorkerShare]:
    """Split `share`'s routing again by `owner` (failover, hedging, spot checks).

    The new shares' tokens index the step's tokens, as the original's do; each expert's rows stay
    together and in order, so any holder of the expert computes the same rows.
    """
    return [WorkerShare(part.worker, share.tokens[part.tokens], part.top_k_index, part.top_k_weights)
            for part in plan_layer(owner, share.top_k_index, share.top_k_weights)]


def share_experts(share: WorkerShare) -> list[int]:
    """The experts a share asks for, ascending."""
    index = share.top_k_index.numpy()
    return np.unique(index[index >= 0]).tolist()
