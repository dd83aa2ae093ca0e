"""The "swarm" experts backend: transformers calls it for every routed MoE layer of every family.

`fn(experts_module, hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]`
is the experts interface's contract. The module carries a binding to the dispatcher and its MoE
layer id; routers, shared experts and attention stay the model's own code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from moeswarm.model.experts import experts_modules, set_experts_implementation

BACKEND_NAME = "swarm"


@dataclass(frozen=True)
class SwarmBinding:
    dispatcher: object  # anything with dispatch(layer, hidden, index, weights) -> handle and combine(handle)
    layer: int


def swarm_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    binding: SwarmBinding = self._moeswarm
    handle = binding.dispatcher.dispatch(binding.layer, hidden_states, top_k_index.long(), top_k_weights)
    return binding.dispatcher.combine(handle)


ALL_EXPERTS_FUNCTIONS.register(BACKEND_NAME, swarm_experts_forward)


def attach(model: torch.nn.Module, dispatcher) -> list[int]:
    """Route every MoE layer of `model` through `dispatcher`; return the MoE layer ids."""
    layers = experts_modules(model)
    for layer, (_, module) in layers.items():
        module._moeswarm = SwarmBinding(dispatcher, layer)
    set_experts_implementation(model, BACKEND_NAME)
    return list(layers)
