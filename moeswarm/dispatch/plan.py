"""Who gets which rows: a pure function of the routing and the expert placement.

Legend: T = tokens in the step, k = router top-k, E = routed experts, W = workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    top_k_index    [T, k] long
    top_k_weights  [T, k]
    """
    slot_owner = owner[top_k_index]  # [T, k]
    if (slot_owner < 0).any():
        missing = sorted(set(top_k_index[slot_owner < 0].tolist()))
        raise LookupError(f"no worker holds experts {missing}")
    shares = []
    for worker in torch.unique(slot_owner).tolist():  # ascending
        mine = slot_owner == worker  # [T, k]
        tokens = mine.any(dim=1).nonzero().squeeze(1)  # [T_w]
        index = torch.where(mine, top_k_index, -1)[tokens]  # [T_w, k]
        shares.append(WorkerShare(worker, tokens, index, top_k_weights[tokens]))
    return shares
