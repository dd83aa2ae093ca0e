"""Matrix products read straight from GGUF blocks (kernels/qkernels.c `qk_matmul`, `qk_matmul_heads`,
`qk_dequantize`), on float32 torch tensors.

The bits of each output value depend only on its weight row and its input row (see the C file):
never on the thread count. The C code trusts the shapes it is given, so each wrapper asserts them
first: a weight's bytes a row equal what `row_length` values of its type take (`row_bytes`).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from moeswarm.kernels import qk_library
from moeswarm.kernels.qk_mirrors import Matmul, MatmulHeads

_BLOCK_SIZES = {int(qtype): sizes for qtype, sizes in GGML_QUANT_SIZES.items()}  # type -> (values, bytes) a block


def row_bytes(qtype: int, row_length: int) -> int:
    """The bytes of one row of `row_length` values of GGUF type `qtype` (a whole number of blocks)."""
    block, type_size = _BLOCK_SIZES[int(qtype)]
    assert row_length > 0 and row_length % block == 0, f"rows of {row_length} values are not whole blocks of {block}"
    return row_length // block * type_size


def _address(array: np.ndarray | torch.Tensor) -> int:
    """The first byte's address (numpy's array interface: cheaper than `.ctypes.data`)."""
    return array.__array_interface__["data"][0] if isinstance(array, np.ndarray) else array.data_ptr()


def address(weight: np.ndarray) -> int:
    """The address of a [rows, row_bytes] matrix of blocks whose rows lie back to back (what the
    kernels read), taken once: `expert` and `experts` take matrices by address."""
    assert weight.ndim == 2 and weight.strides == (weight.shape[1] * weight.itemsize, weight.itemsize)
    return weight.ctypes.data


def matmul(qtype: int, weight: np.ndarray, row_length: int, x: torch.Tensor, threads: int,
           int8_activations: bool = False) -> torch.Tensor:
    """x [n, K] float32 times W^T: W is weight [rows, row_bytes] of `qtype` blocks (K values a row) -> [n, rows].

    int8_activations: for the types in INT8_TYPES, quantize each x row to int8 blocks and take integer
    dot products (llama.cpp's scheme: several times faster, ~0.5-1% relative error from the int8
    rounding of x); otherwise (and for the other types) the decoded weights times float32 x. Either
    way each output's bits depend only on its weight row and its x row."""
    rows, stride = weight.shape
    n = x.shape[0]
    assert x.dtype == torch.float32 and x.shape[1] == row_length and x.stride(1) == 1 and weight.strides[1] == 1
    assert weight.strides[0] == stride == row_bytes(qtype, row_length)  # rows back to back, each whole
    y = torch.empty(n, rows, dtype=torch.float32)
    call = Matmul(qtype, _address(weight), rows, row_length, stride, x.data_ptr(), n, x.stride(0), y.data_ptr(), rows,
                  threads, int8_activations)
    code = qk_library._library().qk_matmul_call(call)
    if code != 0:
        raise RuntimeError(f"qk_matmul failed for GGUF type {qtype} with rows of {row_length} values")
    return y


def matmul_heads(qtype: int, weight: np.ndarray, row_length: int, x: torch.Tensor, threads: int,
                 int8_activations: bool = False) -> torch.Tensor:
    """x [n, H, K] float32, head h times W_h^T: weight [H, rows, row_bytes] holds H matrices of `qtype`
    blocks (K values a row) -> [n, H, rows]. Each head is `matmul` on its matrix and columns (the same
    bits), all in one call: multi-head latent attention's absorbed products (forward/latent.py)."""
    heads, rows, stride = weight.shape
    n = x.shape[0]
    assert x.dtype == torch.float32 and x.shape[1:] == (heads, row_length) and x.stride(2) == 1 and x.stride(1) == row_length
    assert weight.strides == (rows * stride, stride, 1)  # matrices and their rows back to back
    assert stride == row_bytes(qtype, row_length)
    y = torch.empty(n, heads, rows, dtype=torch.float32)
    call = MatmulHeads(qtype, _address(weight), heads, rows * stride, rows, row_length, stride, x.data_ptr(), n,
                       x.stride(0), y.data_ptr(), heads * rows, threads, int8_activations)
    code = qk_library._library().qk_matmul_heads_call(call)
    if code != 0:
        raise RuntimeError(f"qk_matmul_heads failed for GGUF type {qtype} with rows of {row_length} values")
    return y


def dequantize(qtype: int, weight: np.ndarray, row_length: int) -> torch.Tensor:
    """weight [rows, row_bytes] of `qtype` blocks -> [rows, K] float32, decoded by the C kernels."""
    rows = weight.shape[0]
    assert weight.ndim == 2 and weight.shape[1] * weight.itemsize == row_bytes(qtype, row_length)
    out = torch.empty(rows, row_length, dtype=torch.float32)
    if qk_library._library().qk_dequantize(int(qtype), _address(np.ascontiguousarray(weight)), rows, row_length,
                                           weight.shape[1], out.data_ptr()) != 0:
        raise RuntimeError(f"qk_dequantize failed for GGUF type {qtype} with rows of {row_length} values")
    return out

