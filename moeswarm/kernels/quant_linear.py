"""A backbone's Linear and Embedding modules kept in the GGUF file's encoding (16-bit or quantized).

Legend: N = rows of activations, K = in features, O = out features, V = vocabulary.

`--backbone-dtype file` (the default for GGUF files: `open_source(path, backbone_dtype=...)`) puts these in the
place of transformers' nn.Linear / nn.Embedding for every non-expert matrix whose GGUF type the C
kernels decode (F16, BF16 and the quantized types; F32 tensors stay plain parameters). A product is
qkernels.matmul on the file's blocks: for the quantized types with an integer path (Q4_0..Q8_0,
Q4_K..Q6_K) each activation row is rounded to int8 blocks and multiplied with integer dot products,
as llama.cpp computes these matrices and as the workers compute the experts (several times faster
than decoding the weights to float, the output head most of all); F16/BF16 take the float path. An
embedding lookup decodes its rows (the same values as gguf-py's dequantizer). `--backbone-dtype f32` keeps today's float32
parameters. The swarm's backbone and `--check-local`'s reference are built by the same loader, so
both compute the same way.
"""

from __future__ import annotations


import numpy as np
import torch

from moeswarm.errors import ModelError
from moeswarm.kernels import qkernels

MODES = ("file", "f32")  # --backbone-dtype, and a source's experts_dtype: the file's encoding, or float32


def check_dtype(mode: str, part: str) -> str:
    """`mode` when it is one of MODES; ModelError naming `part` ("backbone", "experts") otherwise."""
    if mode not in MODES:
        raise ModelError(f"{part} dtype {mode!r}: expected one of {', '.join(MODES)}")
    return mode


class QuantLinear(torch.nn.Module):
    """y = x W^T (+ b): W [O, K] in GGUF blocks (data: uint8 [O, row_bytes], a view of the file)."""

    def __init__(self, qtype: int, data: np.ndarray, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.qtype, self.data, self.in_features = qtype, data, in_features
        self.out_features = data.shape[0]
        self.int8_activations = qtype in qkernels.INT8_TYPES
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()  # [N, K]
        y = qkernels.matmul(self.qtype, self.data, self.in_features, flat, torch.get_num_threads(),
                            self.int8_activations)  # [N, O]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class QuantEmbedding(torch.nn.Module):
    """Rows of E [V, d] in GGUF blocks, decoded on lookup (data: uint8 [V, row_bytes])."""

    def __init__(self, qtype: int, data: np.ndarray, embedding_dim: int):
        super().__init__()
        self.qtype, self.data, self.embedding_dim = qtype, data, embedding_dim
        self.num_embeddings = data.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).numpy()  # [N]
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range: the vocabulary has {self.num_embeddings} entries")
        rows = qkernels.dequantize(self.qtype, np.ascontiguousarray(self.data[flat]), self.embedding_dim)  # [N, d]
        return rows.reshape(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """The same matrix as an output projection (tied embeddings): logits = h E^T."""
        return QuantLinear(self.qtype, self.data, self.embedding_dim)


def keeps_encoded(qtype: int, row_length: int) -> bool:
    """Whether a matrix of this GGUF type is kept in the file's encoding (never F32: no saving)."""
    return qtype != 0 and qkernels.supported(qtype, row_length)
