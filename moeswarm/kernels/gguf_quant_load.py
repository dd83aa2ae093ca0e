"""A GGUF layer's hosted experts as a `QuantExperts` module: the file's blocks, memory-mapped.

A source opened with `experts_dtype="f32"` (sources/source.py `open_source`; or a missing C
extension, a family whose expert maths the kernels do not do, or a layer stored all in F32) keeps
the float32 path: experts dequantized to float32 into the family's own module. The choice is made
the same way in a worker and in `--check-local`'s reference, so both compute the same way.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeswarm.errors import ModelError
from moeswarm.kernels import qkernels
from moeswarm.gguf.gguf_dequant import check_supported, dequantize
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_names import ArchQuirks, expert_tensor_names
from moeswarm.kernels.quant_experts import QuantExperts, prefault, quant_matrix

_SILU = {"SiLU", "SiLUActivation"}


def activation_of(module: torch.nn.Module, quirks: ArchQuirks) -> str | None:
    """The QuantExperts activation that reproduces `module`'s maths, or None (keep the family's module)."""
    if quirks.experts == "gpt_oss":
        return "gpt_oss" if hasattr(module, "alpha") and hasattr(module, "limit") else None
    if quirks.experts != "gate_up":  # no gate (squared ReLU), or gate and up fused in one tensor
        return None
    return "silu" if type(getattr(module, "act_fn", None)).__name__ in _SILU else None


def use_quantized(f: GGUFFile, layer: int, module: torch.nn.Module, quirks: ArchQuirks, experts_dtype: str) -> bool:
    """Whether the layer's experts are computed from their blocks (experts_dtype "file"). A layer stored
    all in F32 keeps the family's own module: nothing to save, and its bits stay those of the same
    model's HF directory."""
    if experts_dtype != "file" or not qkernels.available() or activation_of(module, quirks) is None:
        return False
    names = expert_tensor_names(layer)
    stored = [f.tensors[names[role]] for role in ("gate", "up", "down") if names[role] in f.tensors]
    return any(t.tensor_type != GGMLQuantizationType.F32 for t in stored)


def quant_experts(f: GGUFFile, layer: int, module: torch.nn.Module, quirks: ArchQuirks,
                  stored_runs: list[range]) -> QuantExperts:
    """The layer's experts at stored positions `stored_runs` (hosted order), computed from their blocks."""
    names = expert_tensor_names(layer)
    if not all(names[role] in f.tensors for role in ("gate", "up", "down")):
        raise ModelError(f"{f.path}: layer {layer} lacks stacked expert tensors blk.{layer}.ffn_{{gate,up,down}}_exps")
    matrices = {}
    for role in ("gate", "up", "down"):
        tensor = f.tensors[names[role]]
        check_supported(f.path, tensor)
        row_length, rows = int(tensor.shape[0]), int(tensor.shape[1])  # ne: [K, rows, experts]
        views = [np.asarray(tensor.data[run.start:run.stop]) for run in stored_runs]  # [n_i, rows, ...]: no copy
        if [len(view) for view in views] != [len(run) for run in stored_runs]:  # numpy clips a slice past the end
            raise ModelError(f"{f.path}: tensor {tensor.name} holds {len(tensor.data)} experts, fewer than the hosted ones")
        matrices[role] = quant_matrix(views, int(tensor.tensor_type), rows, row_length)
        prefault(matrices[role])
    biases = {}
    for role in ("gate_bias", "up_bias", "down_bias"):
        if names[role] in f.tensors:
            pieces = [dequantize(f.path, f.tensors[names[role]], slice(run.start, run.stop)) for run in stored_runs]
            biases[role] = torch.cat(pieces)  # [n, I] or [n, H]
    gate, up, down = matrices["gate"], matrices["up"], matrices["down"]
    inner, hidden = gate.experts[0].shape[0] if gate.experts else 0, module.config.hidden_size
    shapes = {"gate": (inner, gate.row_length), "up": (up.experts[0].shape[0], up.row_length),
              "down": (down.experts[0].shape[0], down.row_length)}
    if shapes != {"gate": (inner, hidden), "up": (inner, hidden), "down": (hidden, inner)}:
        raise ModelError(f"{f.path}: layer {layer} expert matrices have shapes {shapes} (rows, values a row); "
                         f"the model has hidden size {hidden}")
    activation = activation_of(module, quirks)
    return QuantExperts(module.config, gate, up, down, activation, biases,
                        float(getattr(module, "alpha", 0.0)), float(getattr(module, "limit", 0.0)))
