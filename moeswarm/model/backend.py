"""The "swarm" experts backend: transformers calls it for every routed MoE layer of every family.

`fn(experts_module, hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]`
is the experts interface's contract. The module carries a binding to the dispatcher and its MoE
layer id; routers, shared experts and attention stay the model's own code. Between sending the
layer's rows and awaiting them, the block's shared expert is computed (model/overlap.py), and
the experts held in this process run once the remote shares are on their way (worker/local_link.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from moeswarm.model.experts import experts_modules, set_experts_implementation
from moeswarm.model.experts_backend import ExpertsBackend
from moeswarm.model.overlap import SharedOverlap, attach_overlap

BACKEND_NAME = "swarm"


@dataclass(frozen=True)
class SwarmBinding:
    dispatcher: ExpertsBackend
    layer: int
    shared: SharedOverlap | None = None  # the block's shared expert, computed while the trip is in flight


def swarm_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    binding: SwarmBinding = self._moeswarm
    handle = binding.dispatcher.dispatch(binding.layer, hidden_states, top_k_index.long(), top_k_weights)
    if binding.shared is not None:
        binding.shared.compute(hidden_states)
    return binding.dispatcher.combine(handle)


ALL_EXPERTS_FUNCTIONS.register(BACKEND_NAME, swarm_experts_forward)


def attach(model: torch.nn.Module, dispatcher: ExpertsBackend, backends: Mapping[int, ExpertsBackend] | None = None) -> list[int]:
    """Route every MoE layer of `model` through `dispatcher`, or through `backends[layer]` where given
    (the layers held whole in this process: dispatch/in_process.py); return the MoE layer ids."""
    layers = experts_modules(model)
    shared = attach_overlap(model, layers)
    backends = backends or {}
    for layer, (_, module) in layers.items():
        module._moeswarm = SwarmBinding(backends.get(layer, dispatcher), layer, shared.get(layer))
    set_experts_implementation(model, BACKEND_NAME)
    return list(layers)


def set_overlap(model: torch.nn.Module, enabled: bool) -> int:
    """Compute the shared experts during the trip (True) or where the block calls them (False);
    returns how many blocks have a shared expert that can overlap."""
    blocks = [module._moeswarm.shared for _, module in experts_modules(model).values()
              if getattr(module, "_moeswarm", None) is not None and module._moeswarm.shared is not None]
    for block in blocks:
        block.enabled = enabled
    return len(blocks)
