"""GGUF tensor bytes -> float32 torch tensors, with gguf-py's numpy dequantizers.

Quantized tensors are memory-mapped byte arrays whose leading axes are the tensor's outer
dimensions (numpy order: ne reversed) and whose last axis holds the blocks of one row; slicing a
leading axis therefore reads only those rows' bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from gguf.gguf_reader import ReaderTensor

from moeswarm.errors import ModelError

_FLOAT = {Q.F32, Q.F16, Q.BF16}  # F64: gguf-py has no decoder for it
SUPPORTED: frozenset[Q] = frozenset(_FLOAT | set(quants._type_traits))


def check_supported(path, tensor: ReaderTensor) -> None:
    if tensor.tensor_type not in SUPPORTED:
        raise ModelError(
            f"{path}: tensor {tensor.name} has quantization type {tensor.tensor_type.name}, which moeswarm cannot "
            f"dequantize (supported: {', '.join(sorted(t.name for t in SUPPORTED))})"
        )


def dequantize(path, tensor: ReaderTensor, rows: slice | None = None) -> torch.Tensor:
    """Tensor (or rows[rows] of its outermost axis) as float32, in numpy/torch axis order."""
    check_supported(path, tensor)
    data = tensor.data if rows is None else tensor.data[rows]
    values = quants.dequantize(np.asarray(data), tensor.tensor_type)
    # Copy into torch's allocator (64-byte aligned): CPU matmul kernels pick code paths by the
    # weights' alignment, so the same values at another address can give other low-order bits.
    out = torch.empty(values.shape, dtype=torch.float32)
    out.numpy()[...] = values
    return out


def dequantize_array(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Stored bytes (or float values) of `qtype` -> float32 values, with gguf-py's decoders."""
    return quants.dequantize(np.asarray(raw), qtype).astype(np.float32, copy=False)


def raw_rows(tensor: ReaderTensor, rows: slice) -> np.ndarray:
    """The stored bytes of rows[rows] of the outermost axis (quantized blocks untouched)."""
    return np.asarray(tensor.data[rows])
