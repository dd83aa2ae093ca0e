"""Who gets which rows: a pure function of the routing and the expert placement.

Legend: T = tokens in the step, k = router top-k, E = routed experts, W = workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOT_PLANNED = -2  # slot_owner of a slot marked -1 in the routing: belongs to no share here


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
    """
    routed = top_k_index >= 0  # [T, k]
    slot_owner = torch.where(routed, owner[top_k_index.clamp(min=0)], NOT_PLANNED)  # [T, k]
    if (slot_owner == -1).any():
        missing = sorted(set(top_k_index[slot_owner == -1].tolist()))
        raise LookupError(f"no worker holds experts {missing}")
    shares = []
    for worker in torch.unique(slot_owner[routed]).tolist():  # ascending
        mine = slot_owner == worker  # [T, k]
        tokens = mine.any(dim=1).nonzero().squeeze(1)  # [T_w]
        index = torch.where(mine, top_k_index, -1)[tokens]  # [T_w, k]
        shares.append(WorkerShare(worker, tokens, index, top_k_weights[tokens]))
    return shares


def replan_share(share: WorkerShare, owner: torch.Tensor) -> list[WorkerShare]:
    """Split `share`'s routing again by `owner` (failover, hedging, spot checks).

    The new shares' tokens index the step's tokens, as the original's do; each expert's rows stay
    together and in order, so any holder of the expert computes the same rows.
    """
    return [WorkerShare(part.worker, share.tokens[part.tokens], part.top_k_index, part.top_k_weights)
            for part in plan_layer(owner, share.top_k_index, share.top_k_weights)]


def share_experts(share: WorkerShare) -> list[int]:
    """The experts a share asks for, ascending."""
    return torch.unique(share.top_k_index[share.top_k_index >= 0]).tolist()
