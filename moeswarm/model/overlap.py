"""The shared expert computed while a layer's trip is in flight.

A block with a shared expert adds `shared(x)` to the routed experts' output; it does not depend
on the trip. The experts hook (model/backend.py) sends the layer's rows (`dispatch`), then calls
`SharedOverlap.compute` here, then waits for the replies (`combine`): the shared expert's
matmuls run during the round trip instead of before or after it.

Families call the shared expert either before the experts (qwen2_moe: its result is only read
after the experts return) or after them (deepseek_v3: on the same hidden states). The shared
module's `forward` is patched on the instance (names and parameters stay as they are):

  before  the patched forward returns an empty [.., d] buffer and remembers its input; `compute`
          fills the buffer in place between dispatch and combine.
  after   `compute` runs the shared expert on the experts' input; the patched forward returns
          that result when it is called on the same storage, and computes as usual otherwise.

Either way the same module runs on the same rows: bit-identical to eager. Which attribute holds
the shared expert and when the block calls it is one small table (`SHARED_EXPERTS`); a family
not in it keeps its own order. State is per thread: `moeswarm serve` runs one forward per
sequence in its own thread through the same modules.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

BEFORE, AFTER = "before", "after"

# model_type -> (attribute of the MoE block holding the shared expert, when the block calls it)
SHARED_EXPERTS: dict[str, tuple[str, str]] = {
    "qwen2_moe": ("shared_expert", BEFORE),
    "qwen3_next": ("shared_expert", BEFORE),
    "ernie4_5_moe": ("shared_experts", BEFORE),
    "deepseek_v2": ("shared_experts", AFTER),
    "deepseek_v3": ("shared_experts", AFTER),
    "glm4_moe": ("shared_experts", AFTER),
    "dots1": ("shared_experts", AFTER),
}


@dataclass
class _Pending:
    x: torch.Tensor  # [.., d] the shared expert's input
    out: torch.Tensor  # [.., d] the buffer the block holds as the shared expert's output


class SharedOverlap:
    """One block's shared expert, computable between dispatch and combine."""

    def __init__(self, shared: torch.nn.Module, order: str):
        self.shared = shared
        self.order = order
        self.enabled = True
        self.overlapped = 0  # shared-expert outputs the block used that were computed between dispatch and combine
        self._forward = shared.forward  # the module's own (bound) forward
        self._state = threading.local()  # .pending (_Pending | None), .ready ((input, output) | None)
        shared.forward = self._patched

    def _patched(self, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        ready = getattr(state, "ready", None)
        state.ready = None
        if not self.enabled:
            return self._forward(x)
        if self.order == BEFORE:
            state.pending = _Pending(x, torch.empty_like(x))  # filled by `compute` before the block reads it
            return state.pending.out
        if ready is not None and _same_rows(ready[0], x):
            self.overlapped += 1
            return ready[1].view(x.shape)
        return self._forward(x)

    def compute(self, hidden: torch.Tensor) -> None:
        """Between dispatch and combine. hidden [T, d]: the experts' input."""
        state = self._state
        if not self.enabled:
            return
        if self.order == BEFORE:
            pending, state.pending = getattr(state, "pending", None), None
            if pending is None:  # the block did not call its shared expert this time
                return
            out = self._forward(pending.x)
            if out.shape != pending.out.shape or out.dtype != pending.out.dtype:
                raise RuntimeError(f"the shared expert maps {tuple(pending.x.shape)} to {tuple(out.shape)} {out.dtype}: "
                                   "not the same-shaped output the overlap assumes")
            pending.out.copy_(out)
            self.overlapped += 1
        else:
            state.ready = (hidden, self._forward(hidden))


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same rows in the same memory: b is (a view of) a."""
    return (a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
            and a.is_contiguous() and b.is_contiguous())


def attach_overlap(model: torch.nn.Module, experts: dict[int, tuple[str, torch.nn.Module]]) -> dict[int, SharedOverlap]:
    """{layer: its SharedOverlap} for the MoE blocks of `model` whose family is in SHARED_EXPERTS.

    experts: {layer: (qualified name, experts module)}, as model/experts.py finds them; the block
    is the experts module's parent.
    """
    quirk = SHARED_EXPERTS.get(model.config.model_type)
    if quirk is None:
        return {}
    attribute, order = quirk
    found = {}
    for layer, (name, _) in experts.items():
        block = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        shared = getattr(block, attribute, None)
        if isinstance(shared, torch.nn.Module):
            existing = getattr(shared, "_moeswarm_overlap", None)
            found[layer] = existing or SharedOverlap(shared, order)
            shared._moeswarm_overlap = found[layer]
    return found
