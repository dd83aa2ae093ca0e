"""The reference for a batched step: the same concatenated rows through transformers' eager experts.

`serve --check-local` runs every step twice: through the swarm, and on a local model whose MoE
layers meet in their own `StepBatcher` with this as the inner dispatcher. Same sequences, same
slot order, same rows: in exact mode the logits must be bit-identical.
"""

from __future__ import annotations

import torch

from moeswarm.model.experts import experts_modules


class EagerExperts:
    """dispatch/combine over a whole local model's experts, computed by the family's own eager code."""

    def __init__(self, model: torch.nn.Module):
        self._modules = {layer: module for layer, (_, module) in experts_modules(model).items()}

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        module = self._modules[layer]
        forward = type(module).forward
        eager = getattr(forward, "__wrapped__", forward)  # the family's forward, under transformers' interface switch
        return eager(module, hidden, top_k_index, top_k_weights)  # [T, d]

    def combine(self, output: torch.Tensor) -> torch.Tensor:
        return output
