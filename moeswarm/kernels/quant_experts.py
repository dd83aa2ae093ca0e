"""A layer's routed experts kept in their GGUF encoding and computed from it (the C kernels).

Legend: n = experts held, I = intermediate size, H = hidden size, S = rows given to the module,
n_e = rows routed to expert e.

`QuantExperts` stands where the family's experts module stood (transformers' experts interface:
module(hidden [S, H], top_k_index [S, k], top_k_weights [S, k]) -> [S, H]) and does the family's
maths in the family's order: experts ascending, each on its rows (slot-major, then token), its
output scaled by the routing weight and `index_add_`-ed into zeros. Only the expert maths differs:
gate/up/down products come from the C kernels on the file's own blocks, in float32.

A forward is one C call (qkernels.experts, qk_experts in qkernels.c): the grouping by expert, each
expert's gate and up products, activation and down product (qk_expert), the weights and the adds
run there, every float operation the one the per-product sequence (qkernels.matmul, silu_glu or
oss_glu, torch's bias adds, product by the weight and index_add_) does, in its order: the same bits
(tests/test_quant_experts.py), without a Python step per expert or per matrix. Matrices are taken by
address, computed once per QuantMatrix.

Its weights are memory-mapped views of the GGUF file (no copy): a worker's memory holds exactly
the hosted experts' bytes, paged in at load by `prefault`. Tensors of a type the kernels do not
decode are dequantized to float32 once, at load, and computed by the same kernels (type F32).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from moeswarm.kernels import qkernels
from moeswarm.gguf.gguf_dequant import dequantize_array

PAGE = 4096


@dataclass(frozen=True)
class QuantMatrix:
    """One [rows, K] matrix per expert, in GGUF blocks: each is uint8 [rows, row_bytes] (a view of the file)."""

    qtype: int
    experts: tuple[np.ndarray, ...]
    row_length: int  # K: values per row
    # Each expert's matrix by address, taken once (the C kernels read it): no numpy look-up per product.
    blocks: tuple[qkernels.Blocks, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(qkernels.Blocks(self.qtype, qkernels.address(m), m.shape[0], m.nbytes)
                                                 for m in self.experts))

    @property
    def nbytes(self) -> int:
        return sum(int(m.nbytes) for m in self.experts)

    def narrow(self, start: int, stop: int) -> "QuantMatrix":
        return replace(self, experts=self.experts[start:stop])

    def product(self, expert: int, x: torch.Tensor, threads: int) -> torch.Tensor:
        """x [n_e, K] -> [n_e, rows] with expert `expert`'s matrix; x rounded to int8 blocks for the
        integer types, as llama.cpp does (docs/gguf.md, "Integer dot products")."""
        return qkernels.matmul(self.qtype, self.experts[expert], self.row_length, x, threads, int8_activations=True)


def quant_matrix(runs: list[np.ndarray], qtype: int, rows: int, row_length: int) -> QuantMatrix:
    """runs: stored [n_i, rows, ...] slices of a stacked expert tensor (memmap views), in hosted order.

    A type the kernels do not decode is dequantized to float32 here (type F32 from then on).
    """
    if not qkernels.supported(qtype, row_length):  # the float32 fallback, for this tensor only
        runs = [np.ascontiguousarray(dequantize_array(raw, qtype).reshape(raw.shape[0], rows, row_length))
                for raw in runs]
        qtype = int(Q.F32)
    experts = tuple(m for raw in runs for m in raw.view(np.uint8).reshape(raw.shape[0], rows, -1))
    return QuantMatrix(int(qtype), experts, row_length)


def prefault(matrix: QuantMatrix) -> None:
    """Read one byte of every page of the matrix's bytes: the hosted experts are resident from start-up."""
    for m in matrix.experts:
        m.reshape(-1)[::PAGE].sum()


class QuantExperts(torch.nn.Module):
    """The routed experts of one layer, n of them, from GGUF blocks.

    gate, up: [n, I, H] matrices; down: [n, H, I]. activation: "silu" (act(gate) * up: qwen2/3
    MoE, Mixtral, DeepSeek, OLMoE, GLM-4 MoE) or "gpt_oss" (clamped swiglu with alpha and limit,
    biases gate_bias, up_bias [n, I] and down_bias [n, H]).
    """

    # What moeswarm.model.experts recognises an experts module by.
    _is_expert_parallel = False
    is_concatenated = False
    compute_dtype = torch.float32  # hidden states in, outputs out (the worker checks DISPATCHes against it)
    skips_unrouted = True  # forward: an id < 0 routes to no expert; each token's rows are added in eager's order

    def __init__(self, config, gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix, activation: str,
                 biases: dict[str, torch.Tensor] | None = None, alpha: float = 0.0, limit: float = 0.0):
        super().__init__()
        self.config = config
        self.gate, self.up, self.down = gate, up, down
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.biases = biases or {}
        self.num_experts = len(gate.experts)
        # float32 [n, I], [n, I], [n, H] (the bits torch's float32 + bias gives), or None
        self._biases = tuple(self.biases[r].to(torch.float32).contiguous() if r in self.biases else None
                             for r in ("gate_bias", "up_bias", "down_bias"))
        if activation != "gpt_oss":
            self._biases = (None, None, self._biases[2])  # gate and up biases are gpt-oss's only
        self._plan = qkernels.ExpertsPlan(list(gate.blocks), list(up.blocks), list(down.blocks), activation,
                                          *self._biases, alpha, limit)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + sum(b.numel() * 4 for b in self.biases.values())

    def narrow(self, start: int, stop: int) -> "QuantExperts":
        """Experts [start, stop) of this module (views, no copy)."""
        return QuantExperts(self.config, self.gate.narrow(start, stop), self.up.narrow(start, stop),
                            self.down.narrow(start, stop), self.activation,
                            {name: b[start:stop] for name, b in self.biases.items()}, self.alpha, self.limit)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its rows: x [n_e, H] float32 -> [n_e, H], in one C call (qkernels.expert: the bits
        of gate and up products, the activation, the down product, one after another)."""
        gate_bias, up_bias, down_bias = (self._biases[r][e] if self._biases[r] is not None else None
                                         for r in range(3))
        return qkernels.expert(self.gate.blocks[e], self.up.blocks[e], self.down.blocks[e], x.contiguous(),
                               torch.get_num_threads(), self.activation, gate_bias, up_bias, down_bias,
                               self.alpha, self.limit)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if top_k_weights.dtype in _EXACT_WEIGHTS:  # the whole layer in one C call, in the same order and operations
            with torch.no_grad():
                return qkernels.experts(self._plan, hidden_states if hidden_states.stride(-1) == 1 else
                                        hidden_states.contiguous(), top_k_index.to(torch.int64).contiguous(),
                                        top_k_weights.to(torch.float32).contiguous(), torch.get_num_threads())
        final = torch.zeros_like(hidden_states)  # [S, H]
        with torch.no_grad():
            hit = torch.unique(top_k_index[top_k_index >= 0]).tolist()  # ascending, as eager visits them
            for e in hit:
                slot, token = torch.where(top_k_index.T == e)  # [n_e] each: slot-major, then token (eager's order)
                out = self.expert(e, hidden_states[token]) * top_k_weights[token, slot, None]  # [n_e, H]
                final.index_add_(0, token, out.to(final.dtype))
        return final


# Routing weights whose product with float32 outputs is the float32 product of their float32 values
# (torch promotes them so): qk_experts takes them as float32. Others (float64) take the loop above.
_EXACT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16)
