"""MoE layers whose every expert this process holds: the experts module runs where the model calls it.

The local mode (`generate` and `serve` without workers) holds every expert, and a backbone may
hold every expert of some layers (`--local-experts`). Such a layer needs no plan, no request, no
copy of its rows and no combine: `combine` calls the layer's experts module on the hidden states
as they are, which is what the reference model (`load_local`) calls there, with the same module
(the family's eager experts, or QuantExperts over the GGUF blocks): the same bits, at
`load_local`'s speed. Routing counts and the layer call's accounting are kept as for a
dispatched layer (the dashboard and `--json` report them); the call makes no round trip.

Legend: T = tokens in the step, k = router top-k, d = hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moeswarm.dispatch.accounting import Accounting, LayerCall
from moeswarm.ids import LayerId
from moeswarm.placement.profile import RoutingStats


@dataclass(frozen=True)
class InProcessHandle:
    layer: LayerId
    hidden: torch.Tensor  # [T, d]
    top_k_index: torch.Tensor  # [T, k] long
    top_k_weights: torch.Tensor  # [T, k]
    started: float  # time.perf_counter()


class InProcess:
    """The experts backend (dispatch -> handle, combine(handle) -> [T, d]) of the layers in `modules`.

    modules: {layer: the family's experts module holding every expert of the layer, eager}.
    """

    def __init__(self, modules: Mapping[int, torch.nn.Module], routing: RoutingStats, accounting: Accounting):
        self.modules = {LayerId(layer): module for layer, module in modules.items()}
        self.routing = routing
        self.accounting = accounting

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> InProcessHandle:
        """hidden [T, d], top_k_index [T, k] long, top_k_weights [T, k]: nothing leaves the process."""
        return InProcessHandle(LayerId(layer), hidden, top_k_index, top_k_weights, time.perf_counter())

    def combine(self, handle: InProcessHandle) -> torch.Tensor:
        """The layer's routed output [T, d]: sum over each row's experts of weight * expert(row)."""
        out = self.modules[handle.layer](handle.hidden, handle.top_k_index, handle.top_k_weights)  # [T, d]
        self.routing.update(handle.layer, handle.top_k_index, handle.top_k_weights)
        self.accounting.record(LayerCall(handle.layer, handle.hidden.shape[0], 0, 0, 0,
                                         time.perf_counter() - handle.started, {}, 0))
        return out


class ByLayer:
    """One experts backend over two: the layers in `in_process` run there, every other layer through
    `dispatcher`. What a wrapper that sees every layer (serve's StepBatcher) stands in front of."""

    def __init__(self, dispatcher, in_process: Mapping[int, InProcess]):
        self.dispatcher = dispatcher
        self.in_process = dict(in_process)

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        backend = self.in_process.get(layer, self.dispatcher)
        return backend, backend.dispatch(layer, hidden, top_k_index, top_k_weights)

    def combine(self, handle) -> torch.Tensor:
        backend, inner = handle
        return backend.combine(inner)
