"""Blockwise 8-bit codecs: int8 (absmax) and fp8-e4m3, one bf16 scale per block of the last axis.

Legend: R = rows (all axes but the last), d = last axis, B = block size, n_b = ceil(d / B).

Payload: scales [R, n_b] bf16, then codes [R, d] one byte each. A block's scale maps its largest
magnitude onto the code's largest value (127 for int8, 448 for e4m3), so every finite value is
representable; a zero block has scale 0 and decodes to zeros. The scale is rounded to bf16
first and the codes computed with the rounded scale, so decode(encode(x)) is consistent.

Non-finite values (NaN, inf) cannot be carried by a scaled 8-bit code: encode refuses them with
an error instead of sending something else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeswarm.errors import ProtocolError

BLOCK_SIZES = (32, 64, 128)
_KINDS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


@dataclass(frozen=True)
class BlockwiseCodec:
    kind: str  # "int8" or "fp8"
    block: int

    @property
    def name(self) -> str:
        return f"{self.kind}-b{self.block}"

    def nbytes(self, shape: tuple[int, ...]) -> int:
        rows, width = _rows_width(shape)
        return rows * math.ceil(width / self.block) * 2 + rows * width

    def encode(self, tensor: torch.Tensor) -> memoryview:
        code_dtype, top = _KINDS[self.kind]
        rows, width = _rows_width(tuple(tensor.shape))
        x = tensor.detach().float().reshape(rows, width)  # [R, d]
        if not torch.isfinite(x).all():
            raise ProtocolError(f"codec {self.name} cannot carry non-finite values (NaN or inf in the tensor)")
        blocks = math.ceil(width / self.block)
        padded = torch.nn.functional.pad(x, (0, blocks * self.block - width)).view(rows, blocks, self.block)  # [R, n_b, B]
        scale = (padded.abs().amax(dim=-1) / top).to(torch.bfloat16)  # [R, n_b]
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
        scaled = (padded / safe.unsqueeze(-1)).clamp(-top, top)  # [R, n_b, B]
        codes = scaled.round().to(code_dtype) if self.kind == "int8" else scaled.to(code_dtype)
        codes = codes.view(rows, blocks * self.block)[:, :width].contiguous()  # [R, d]
        data = scale.contiguous().view(torch.int16).numpy().tobytes() + codes.view(torch.uint8).numpy().tobytes()
        return memoryview(data)

    def decode(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        code_dtype, _ = _KINDS[self.kind]
        rows, width = _rows_width(shape)
        blocks = math.ceil(width / self.block)
        split = rows * blocks * 2
        scale = torch.frombuffer(bytearray(data[:split]), dtype=torch.int16).view(torch.bfloat16).float().view(rows, blocks)
        codes = torch.frombuffer(bytearray(data[split:]), dtype=torch.uint8).view(code_dtype).float().view(rows, width)
        codes = torch.nn.functional.pad(codes, (0, blocks * self.block - width)).view(rows, blocks, self.block)
        values = (codes * scale.unsqueeze(-1)).view(rows, blocks * self.block)[:, :width]  # [R, d]
        return values.reshape(shape).to(dtype)


def _rows_width(shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


BLOCKWISE_CODECS = [BlockwiseCodec(kind, block) for kind in _KINDS for block in BLOCK_SIZES]
