"""Which backbone matrices of a GGUF file stay in the file's encoding, and their modules.

Each nn.Linear / nn.Embedding whose weight is a plain GGUF tensor (stored as it is: not
permuted, not merged) of a type the C kernels decode, other than F32, is replaced by a
QuantLinear / QuantEmbedding over the memory-mapped blocks (kernels/quant_linear.py). Everything
else is loaded as float32 parameters, as before. Nothing is replaced with `--backbone-dtype f32`.
"""

from __future__ import annotations

import numpy as np
import torch

from moeswarm.errors import ModelError
from moeswarm.kernels import qkernels
from moeswarm.gguf.gguf_dequant import dequantize
from moeswarm.gguf.gguf_names import NameMapper
from moeswarm.kernels.quant_linear import QuantEmbedding, QuantLinear, check_dtype, keeps_encoded


def encode_backbone(model: torch.nn.Module, mapper: NameMapper, skip: set[str], mode: str = "file") -> set[str]:
    """Replace the eligible modules of `model` in place (mode "file"; "f32": none); returns the
    parameter names they took over."""
    if check_dtype(mode, "backbone") != "file" or not qkernels.available():
        return set()
    f, taken = mapper.file, set()
    for module_name, module in list(model.named_modules()):
        if type(module) not in (torch.nn.Linear, torch.nn.Embedding) or f"{module_name}.weight" in skip:
            continue
        tensor_name = mapper.plain_tensor(f"{module_name}.weight")
        if tensor_name is None:
            continue
        tensor = f.tensors[tensor_name]
        ne = [int(n) for n in tensor.shape]
        row_length, rows = ne[0], (ne[1] if len(ne) > 1 else 1)
        if [n for n in ne[2:] if n != 1] or (rows, row_length) != tuple(module.weight.shape):
            continue
        if not keeps_encoded(int(tensor.tensor_type), row_length):
            continue
        data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)  # [rows, row_bytes]: a view of the file
        if isinstance(module, torch.nn.Embedding):
            replacement = QuantEmbedding(int(tensor.tensor_type), data, row_length)
        else:
            bias_name = mapper.plain_tensor(f"{module_name}.bias") if module.bias is not None else None
            if bias_name and int(f.tensors[bias_name].n_elements) != rows:
                raise ModelError(f"{f.path}: tensor {bias_name} has {int(f.tensors[bias_name].n_elements)} values, "
                                 f"{tensor_name} has {rows} rows")
            bias = dequantize(f.path, f.tensors[bias_name]).reshape(rows) if bias_name else None
            if module.bias is not None and bias is None:
                continue
            replacement = QuantLinear(int(tensor.tensor_type), data, row_length, bias)
            taken.add(f"{module_name}.bias")
        model.set_submodule(module_name, replacement)
        taken.add(f"{module_name}.weight")
    return taken


def tie_encoded(model: torch.nn.Module) -> bool:
    """Tied embeddings kept encoded: the output projection is the same blocks. False when not encoded."""
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, QuantEmbedding):
        return False
    model.set_output_embeddings(embedding.as_linear())
    return True
