"""Float32 matrices whose products give each row the same bits in any batch.

torch's `F.linear` takes one BLAS routine for one row (a matrix-vector product) and another for
several (a matrix-matrix product), and the two associate the dot products differently: a token's
router logits in a batched step differ in the last bits from the same token's logits alone, the
routing weights differ, and a greedy request served next to others can pick another token than it
would alone. The routers of a GGUF file (`ffn_gate_inp`, F32 in llama.cpp's quantized files) are
such matrices, and so is any other F32 matrix of the file's backbone.

`RowInvariantWeight` marks such a parameter: `F.linear` with it as the weight (how transformers'
routers and nn.Linear use their weights) runs on qkernels' float path, where each output's bits
depend only on its weight row and its input row, whatever the batch and the thread count (the
association is fixed: kernels/qkernels.c). Every other use of the tensor is torch's, and gives
plain tensors. The local reference is loaded the same way, so `--check-local` compares like with
like.

Legend: N = input rows, K = in features, O = out features.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moeswarm.kernels import qkernels

F32 = 0  # GGUF's type code of float32 rows
ONE_THREAD_MACS = 1 << 22  # below this many multiply-adds a second thread's wake-up costs more than it saves


class RowInvariantWeight(torch.Tensor):
    """W [O, K] float32; F.linear(x, W, b) runs on qkernels' float path (see the module docstring).
    `rows`: the same memory as uint8 [O, 4K], as qkernels reads it (set by make_rows_invariant)."""

    rows: np.ndarray

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if type(weight) is cls and type(x) is torch.Tensor and x.dtype == torch.float32 and not x.requires_grad:
                return _linear(x, weight, bias)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func is torch.Tensor.detach:  # what nn.Parameter makes of it: the same kind of tensor
            return result.as_subclass(cls)
        return result


def _linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features).contiguous()  # [N, K]
    threads = 1 if flat.shape[0] * out_features * in_features < ONE_THREAD_MACS else torch.get_num_threads()
    y = qkernels.matmul(F32, weight.rows, in_features, flat, threads)  # [N, O]: the bits do not depend on threads
    if bias is not None:
        with torch._C.DisableTorchFunctionSubclass():
            y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


def make_rows_invariant(model: torch.nn.Module) -> list[str]:
    """Mark every 2-D float32 `weight` parameter of `model`'s non-embedding modules as a
    RowInvariantWeight (in place, sharing memory; tied parameters stay tied). Returns their names."""
    if not qkernels.available():
        return []
    marked, done = [], {}
    for module_name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if isinstance(module, torch.nn.Embedding) or weight is None:
            continue
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.is_meta or not weight.is_contiguous():
            continue
        if not qkernels.supported(F32, weight.shape[1]):
            continue
        if id(weight) not in done:
            marked_weight = torch.nn.Parameter(weight.detach().as_subclass(RowInvariantWeight), requires_grad=False)
            marked_weight.rows = weight.detach().numpy().view(np.uint8)  # [O, 4K]: the same memory
            done[id(weight)] = marked_weight
        module._parameters["weight"] = done[id(weight)]
        marked.append(f"{module_name}.weight" if module_name else "weight")
    return marked
