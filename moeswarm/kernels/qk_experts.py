"""Experts in one C call each (kernels/qkernels.c `qk_expert`, `qk_experts`, `qk_dispatch_sums`,
`qk_dispatch_rows`): one expert, a layer's routed experts on a batch, a DISPATCH's experts from
its frame's bytes. Each gives the bits of the eager experts' operations in their order.

The C code trusts the shapes it is given: an expert's matrix must hold at least its rows' bytes
(`Blocks.nbytes`). A model file's shapes reach here only after gguf/gguf_header.py and
gguf_bounds.py have checked them; these asserts are the last fence.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from moeswarm.kernels import qk_library
from moeswarm.kernels.qk_matmul import _address, row_bytes
from moeswarm.kernels.qk_mirrors import Dispatch, Expert, ExpertSet, Experts

# qk_expert's activations.
ACTIVATIONS = {"silu": 0, "gpt_oss": 1}


class Blocks(NamedTuple):
    """A [rows, K] matrix of GGUF blocks by `address` (its rows back to back), for `expert` and `experts`."""

    qtype: int
    address: int
    rows: int
    nbytes: int = -1  # the matrix's bytes, checked against rows and the row length (-1: unknown, refused)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    assert tensor.dtype == torch.float32 and tensor.is_contiguous()
    return tensor.data_ptr()


def expert(gate: Blocks, up: Blocks, down: Blocks, x: torch.Tensor, threads: int, activation: str = "silu",
           gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
           down_bias: torch.Tensor | None = None, alpha: float = 0.0, limit: float = 0.0,
           int8_activations: bool = True) -> torch.Tensor:
    """One expert in one C call: x [n, H] float32 -> [n, H]. gate, up: [I, H] blocks; down: [H, I].

    The bits of the sequence matmul(gate), matmul(up), then silu_glu, or for "gpt_oss" the gate and
    up biases added and oss_glu, then matmul(down) and + down_bias, each matmul with
    `int8_activations` (biases: float32, contiguous, [I], [I], [H]; None for none)."""
    n, hidden = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and up.rows == gate.rows and down.rows == hidden
    _check_blocks([gate], [up], [down])
    out = torch.empty(n, hidden, dtype=torch.float32)
    call = Expert(gate.qtype, gate.address, up.qtype, up.address, down.qtype, down.address, hidden, gate.rows,
                  x.data_ptr(), n, x.stride(0), _pointer(gate_bias), _pointer(up_bias), _pointer(down_bias),
                  ACTIVATIONS[activation], alpha, limit, out.data_ptr(), hidden, threads, int8_activations)
    code = qk_library._library().qk_expert_call(call)
    if code != 0:
        raise RuntimeError(f"qk_expert failed for GGUF types {gate.qtype}, {up.qtype}, {down.qtype} "
                           f"(hidden size {hidden}, intermediate size {gate.rows})")
    return out


def _check_blocks(gate: list[Blocks], up: list[Blocks], down: list[Blocks]) -> None:
    """Every expert's gate and up [I, H] and down [H, I] hold at least their rows' bytes (what the C code reads)."""
    if not gate:
        return
    inner, hidden = gate[0].rows, down[0].rows
    for role, blocks, rows, row_length in (("gate", gate, inner, hidden), ("up", up, inner, hidden),
                                           ("down", down, hidden, inner)):
        for b in blocks:
            assert b.rows == rows and b.nbytes >= rows * row_bytes(b.qtype, row_length), (
                f"{role} blocks of {b.nbytes} bytes for {b.rows} rows of {row_length} values (type {b.qtype})")


class ExpertsPlan:
    """A layer's n experts as qk_experts takes them (`set`, kernels/qk_calls.h QkExpertSet), made once:
    each call's struct points to it.

    gate, up, down: each expert's Blocks (one type per role); biases float32 [n, I], [n, I], [n, H] or None."""

    def __init__(self, gate: list[Blocks], up: list[Blocks], down: list[Blocks], activation: str,
                 gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 alpha: float, limit: float):
        n = len(gate)
        assert len({b.qtype for b in gate}) <= 1 and len({b.qtype for b in up}) <= 1 and len({b.qtype for b in down}) <= 1
        assert len(up) == len(down) == n
        _check_blocks(gate, up, down)
        self.num_experts = n
        self.hidden = down[0].rows if n else 0
        self.inner = gate[0].rows if n else 0
        self.types = tuple(m[0].qtype if n else 0 for m in (gate, up, down))  # gate, up, down
        self.activation, self.alpha, self.limit = ACTIVATIONS[activation], alpha, limit
        self._tables = [(ctypes.c_int64 * max(n, 1))(*(b.address for b in m)) for m in (gate, up, down)]
        self._biases = (gate_bias, up_bias, down_bias)  # kept alive: the C code reads them by address
        self.matrices = tuple(ctypes.addressof(t) for t in self._tables)  # gate, up, down: [n] addresses each
        self.biases = tuple(_pointer(b) for b in self._biases)  # gate, up, down (None: none)
        self.set = ExpertSet(n, *self.matrices, *self.types, self.hidden, self.inner, *self.biases, self.activation,
                             alpha, limit)
        self.set_at = ctypes.addressof(self.set)  # what each call's struct points to


def dispatch_sums(plan: ExpertsPlan, hidden: int, tokens: int, ids: int, id_bytes: int, k: int, weights: int,
                  table: np.ndarray, final: np.ndarray, counts: np.ndarray, threads: int) -> int:
    """A partial DISPATCH's per-token sums from its frame's bytes, in one C call (the bits of `experts`
    on the same rows, ids and weights): hidden, ids and weights are the addresses of the tensors as
    they travel (float32 [tokens, H]; [tokens, k] ids of id_bytes each, u8 with 255 for -1; float32
    [tokens, k]), mapped through table [E + 3] (position id + 2, clipped: the id within this module,
    -1, or < -1 for not held). final [tokens, H] float32 zeros, counts [n] int64: written.
    0, -3 (an id not held here, or no slot routed: nothing computed), or another failure code."""
    assert final.dtype == np.float32 and final.shape == (tokens, plan.hidden) and final.flags.c_contiguous
    assert counts.dtype == np.int64 and counts.shape == (plan.num_experts,) and table.dtype == np.int64
    call = Dispatch(plan.set_at, hidden, tokens, ids, id_bytes, k, weights, _address(table), len(table), _address(final),
                    tokens, _address(counts), None, None, threads, 1)
    return qk_library._library().qk_dispatch_sums_call(call)


def dispatch_rows(plan: ExpertsPlan, hidden: int, tokens: int, ids: int, id_bytes: int, k: int, weights: int,
                  table: np.ndarray, rows: np.ndarray, found: np.ndarray, threads: int) -> int:
    """An exact DISPATCH's rows from its frame's bytes, in one C call (the bits of `experts` over the
    pairs' rows, as the worker's exact path runs it): addresses and table as in `dispatch_sums`.
    rows [tokens * k, H] float32 zeros: the routed pairs' rows w * E(x) first, experts ascending,
    each slot-major then token. found [2 n + 1] int64: the hit experts (within this module)
    ascending, then their row counts, then how many were hit. 0, -3 (nothing computed), or a failure code."""
    n = plan.num_experts
    assert rows.dtype == np.float32 and rows.shape == (tokens * k, plan.hidden) and rows.flags.c_contiguous
    assert found.dtype == np.int64 and found.shape == (2 * n + 1,) and table.dtype == np.int64
    base = _address(found)
    call = Dispatch(plan.set_at, hidden, tokens, ids, id_bytes, k, weights, _address(table), len(table), _address(rows),
                    rows.shape[0], base + 8 * n, base, base + 16 * n, threads, 1)
    return qk_library._library().qk_dispatch_rows_call(call)


def experts(plan: ExpertsPlan, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, threads: int,
            int8_activations: bool = True) -> torch.Tensor:
    """The layer's experts on S rows in one C call, in the eager experts' order and float operations:
    hidden [S, H] float32 (rows of stride >= H, values contiguous), index [S, k] int64 (< 0: none),
    weights [S, k] float32, both contiguous -> [S, H]: for e ascending, rows routed to e slot-major
    then token, final[token] += expert_e(hidden[token]) * weight, from zeros."""
    S, H = hidden.shape
    k = index.shape[1]
    assert hidden.dtype == torch.float32 and hidden.stride(1) == 1 and H == plan.hidden
    assert index.dtype == torch.int64 and index.is_contiguous() and index.shape == weights.shape == (S, k)
    assert weights.dtype == torch.float32 and weights.is_contiguous()
    final = torch.zeros(S, H, dtype=torch.float32)
    call = Experts(plan.set_at, hidden.data_ptr(), S, hidden.stride(0), index.data_ptr(), k, weights.data_ptr(),
                   final.data_ptr(), threads, int8_activations)
    code = qk_library._library().qk_experts_call(call)
    if code == -2:
        bad = index[index >= plan.num_experts][0].item()
        raise ValueError(f"expert id {bad} out of range: this module holds experts 0-{plan.num_experts - 1}")
    if code != 0:
        raise RuntimeError(f"qk_experts failed (GGUF types {plan.types}, out of memory or an unsupported type)")
    return final
