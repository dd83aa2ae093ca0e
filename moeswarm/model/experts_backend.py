"""The experts backend protocol: what the model's MoE layers call, whatever computes the experts.

Dispatch and combine are a pair joined by a handle (DeepEP's shape): `dispatch` sends (or starts)
a layer's rows and returns at once; the caller may compute local work (the shared expert) before
`combine` gathers the result. Implemented by the dispatcher (dispatch/dispatcher.py: remote
holders), the in-process backends (dispatch/in_process.py: layers held whole here), the engine's
meeting points (engine/turns.py: groups taking turns; engine/batcher.py: a thread per sequence) and
the eager reference (engine/eager.py).

Legend: T = tokens of the call, k = router top-k, d = hidden size.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ExpertsBackend(Protocol):
    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        """Start MoE layer `layer` on these rows; returns the handle `combine` takes.

        hidden [T, d] in the model's dtype; top_k_index [T, k] long (-1: no expert); top_k_weights
        [T, k] in the router's dtype."""

    def combine(self, handle: Any) -> torch.Tensor:
        """The layer's routed-experts output [T, d] (hidden's dtype) for `handle`'s rows: sum over
        each row's k experts of weight x expert(row)."""
