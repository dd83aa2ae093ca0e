"""Multi-head latent attention's per-head matrices kept in a GGUF file's blocks, for absorbed steps.

llama.cpp's converter splits DeepSeek's kv_b_proj into attn_k_b (per head, W_uk transposed: [r, nope]
a head) and attn_v_b (W_uv: [v, r] a head) and stores them quantized. The module still gets
kv_b_proj, merged and decoded to float32 (gguf_names.py), for the forms that expand the cache; an
absorbed step (forward/latent.py) multiplies by these blocks instead, as llama.cpp does, with
int8 activations: at GLM-4.7-Flash's shape a layer's two products read 2.8 MB of blocks in place
of kv_b_proj's 18.4 MB of float32, every decode step.

Legend: H = heads, r = kv_lora_rank, nope = qk_nope_head_dim, v = v_head_dim, n = rows (queries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeswarm.kernels import qkernels
from moeswarm.gguf.gguf_names import NameMapper
from moeswarm.kernels.quant_linear import check_dtype, keeps_encoded

BLOCKS = "_moeswarm_absorb_blocks"  # on an attention module: (W_uk, W_uv) as HeadMatrices


@dataclass(frozen=True)
class HeadMatrices:
    """H matrices of one GGUF tensor in its blocks: data [H, rows, row_bytes] (a view of the file),
    each row `row_length` values."""

    qtype: int
    data: np.ndarray
    row_length: int

    def product(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """x [n, H, row_length] -> [n, H, rows]: head h's columns times its matrix, int8 activations."""
        return qkernels.matmul_heads(self.qtype, self.data, self.row_length, x, threads, int8_activations=True)


def encode_latent(model: torch.nn.Module, mapper: NameMapper, skip: set[str], mode: str = "file") -> int:
    """Give every latent attention module of `model` whose layer's attn_k_b and attn_v_b the kernels
    compute from their blocks those blocks (attribute BLOCKS); returns how many got them. None with
    `--backbone-dtype f32` (mode "f32"): every product then stays float32."""
    if check_dtype(mode, "backbone") != "file" or not qkernels.available():
        return 0
    given = 0
    for name, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if not hasattr(module, "kv_b_proj") or layer is None or f"{name}.kv_b_proj.weight" in skip:
            continue
        heads = _heads(mapper, f"blk.{layer}.attn_k_b.weight"), _heads(mapper, f"blk.{layer}.attn_v_b.weight")
        if None in heads:
            continue
        k_b, v_b = heads
        r, nope, v = module.kv_lora_rank, module.qk_nope_head_dim, module.v_head_dim
        if (k_b.data.shape[:2], k_b.row_length, v_b.data.shape[:2], v_b.row_length) != \
                ((module.num_heads, r), nope, (module.num_heads, v), r):
            continue
        setattr(module, BLOCKS, (k_b, v_b))
        given += 1
    return given


def _heads(mapper: NameMapper, tensor_name: str) -> HeadMatrices | None:
    """The file's [H, rows, row_length] tensor as HeadMatrices, or None (absent, or not kept encoded)."""
    tensor = mapper.file.tensors.get(tensor_name)
    if tensor is None:
        return None
    ne = [int(n) for n in tensor.shape]  # ggml order: row length, rows, heads
    if len(ne) != 3 or not keeps_encoded(int(tensor.tensor_type), ne[0]):
        return None
    data = np.asarray(tensor.data).view(np.uint8).reshape(ne[2], ne[1], -1)  # [H, rows, row_bytes]: a view of the file
    return HeadMatrices(int(tensor.tensor_type), data, ne[0])
