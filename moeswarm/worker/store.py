"""The experts a worker hosts, and the maths it runs on a DISPATCH.

Legend: T = dispatched tokens, k = router top-k, d = hidden size, n_e = rows routed to expert e.

Each expert runs the family's own experts class with the eager implementation, on exactly the
rows routed to it in eager's order (slot-major, then token), as a one-expert problem: the same
inputs through the same kernels give the same bits as a local eager run.
"""

from __future__ import annotations

import torch

from moeswarm.errors import ProtocolError
from moeswarm.ids import LayerId
from moeswarm.model.loading import ExpertSlice
from moeswarm.wire.messages import Dispatch, Result


class ExpertStore:
    def __init__(self, slices: dict[LayerId, ExpertSlice], num_experts: int, hidden_size: int):
        for hosted in slices.values():
            mirror_alignment(hosted.module, hosted.low)
        self.slices = slices
        self.num_experts = num_experts
        self.hidden_size = hidden_size

    @property
    def layers(self) -> list[int]:
        return sorted(self.slices)

    @property
    def experts(self) -> list[int]:
        return list(next(iter(self.slices.values())).experts)

    def describe(self) -> str:
        layers, experts = self.layers, self.experts
        return f"layers {_span(layers)}, experts {_span(experts)}"

    @torch.inference_mode()
    def run(self, request: Dispatch) -> Result:
        hosted = self._check(request)
        hidden, index, weights = request.hidden, request.top_k_index, request.top_k_weights  # [T, d], [T, k], [T, k]
        hit = torch.unique(index[index >= 0]).tolist()  # ascending, as eager visits them
        slots, tokens = zip(*(torch.where(index.T == expert) for expert in hit))  # per expert: [n_e] each, eager's order
        counts = [t.numel() for t in tokens]
        rows = torch.cat(tokens)  # [S]: the (token, expert) pairs, grouped by expert
        local = torch.repeat_interleave(torch.tensor(hit) - hosted.low, torch.tensor(counts)).unsqueeze(1)  # [S, 1]
        pair_weights = torch.cat([weights[t, s] for t, s in zip(tokens, slots)]).unsqueeze(1)  # [S, 1]
        # One call of the family's eager experts over all pairs: each expert sees exactly its rows in
        # eager's order (the same matrices as a local run), and each output row is one pair's w * E(x).
        outputs = hosted.module(hidden[rows], local, pair_weights)  # [S, d]
        if request.mode == "partial":
            outputs = torch.zeros_like(hidden).index_add_(0, rows, outputs)  # [T, d], experts added in ascending order
        return Result(request.layer, request.mode, outputs, hit, counts, request.wire_combine)

    def _check(self, request: Dispatch) -> ExpertSlice:
        hosted = self.slices.get(LayerId(request.layer))
        if hosted is None:
            raise ProtocolError(f"layer {request.layer} is not served by this worker (it serves {self.describe()})")
        tokens, width = request.hidden.shape
        if width != self.hidden_size:
            raise ProtocolError(f"hidden size {width} does not match the model's {self.hidden_size}")
        dtype = next(hosted.module.parameters()).dtype
        if request.hidden.dtype != dtype:
            raise ProtocolError(f"dtype mismatch: hidden states are {request.hidden.dtype}, the experts compute in {dtype}")
        if not request.top_k_weights.is_floating_point():
            raise ProtocolError(f"routing weights must be floating point, got {request.top_k_weights.dtype}")
        if tokens == 0:
            raise ProtocolError("DISPATCH with no tokens")
        index = request.top_k_index
        chosen = index[index >= 0]
        if (index < -1).any() or (chosen >= self.num_experts).any():
            bad = index[(index < -1) | (index >= self.num_experts)][0].item()
            raise ProtocolError(f"expert id {bad} out of range: the model has experts 0-{self.num_experts - 1}")
        if chosen.numel() == 0:
            raise ProtocolError("DISPATCH routes no token to any expert (every id is -1)")
        outside = chosen[(chosen < hosted.low) | (chosen > hosted.high)]
        if outside.numel():
            raise ProtocolError(
                f"expert {outside[0].item()} of layer {request.layer} is not held by this worker "
                f"(it holds experts {hosted.low}-{hosted.high})"
            )
        return hosted


def mirror_alignment(module: torch.nn.Module, first_expert: int, quantum_bytes: int = 64) -> None:
    """Place each hosted expert's weights at the same address alignment as in a full local model.

    CPU matmul kernels take different paths (and give different low-order bits) depending on how
    an operand's address sits against the 64-byte vector width. In a local model, expert e of a
    stacked [E, ...] parameter starts e * expert_bytes past a 64-byte-aligned base; a worker
    holding experts from `first_expert` on would start its expert 0 at a different residue unless
    its buffer is shifted to match.
    """
    for name, param in list(module.named_parameters(recurse=False)):
        itemsize = param.element_size()
        expert_bytes = param[0].numel() * itemsize
        if expert_bytes % quantum_bytes == 0 or quantum_bytes % itemsize:
            continue  # every expert already starts at the same residue
        buffer = torch.empty(param.numel() + quantum_bytes // itemsize, dtype=param.dtype)
        want = (first_expert * expert_bytes) % quantum_bytes
        shift = ((want - buffer.data_ptr()) % quantum_bytes) // itemsize
        view = buffer[shift : shift + param.numel()].view(param.shape)
        view.copy_(param.detach())
        setattr(module, name, torch.nn.Parameter(view, requires_grad=False))


def _span(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if values else "none"
