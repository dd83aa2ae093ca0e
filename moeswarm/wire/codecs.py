"""Tensor encodings on the wire, in one registry.

A codec turns a tensor into bytes and back. `exact` combine needs lossless codecs (the tensor's
own dtype); lossy ones (f16 or bf16 for f32 data, blockwise int8/fp8) trade bits for bytes. Every
codec declares its size up front (`nbytes`) so a receiver checks a payload's length before
decoding.

Special values: `f32` and `bf16` carry NaN and +-inf as they are (bf16 has f32's range, so
only mantissa bits are lost). `f16` keeps NaN and +-inf but saturates finite values beyond its
range to +-65504 (a plain cast would turn them into inf). The blockwise 8-bit codecs refuse
non-finite values (see blockwise.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from moeswarm.errors import ProtocolError
from moeswarm.wire.blockwise import BLOCKWISE_CODECS

DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "u8": torch.uint8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# each raw codec's wire dtype -> its little-endian numpy dtype (bf16, which numpy lacks, as int16: the same bytes)
WIRE_NUMPY = {torch.float32: np.dtype("<f4"), torch.float16: np.dtype("<f2"), torch.bfloat16: np.dtype("<i2"),
              torch.uint8: np.dtype("u1"), torch.int16: np.dtype("<i2"), torch.int32: np.dtype("<i4"),
              torch.int64: np.dtype("<i8")}
MAX_RANK = 4


@dataclass(frozen=True)
class RawCodec:
    """Little-endian bytes of the tensor cast to `wire_dtype`; decoded back to the asked dtype."""

    name: str
    wire_dtype: torch.dtype

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.wire_dtype.itemsize

    def encode(self, tensor: torch.Tensor) -> memoryview:
        wire = tensor.detach()
        if wire.dtype != self.wire_dtype:  # a tensor already in its wire dtype (lossless) goes as it is
            if self.wire_dtype == torch.float16 and wire.is_floating_point():
                limit = torch.finfo(torch.float16).max
                wire = torch.where(torch.isfinite(wire), wire.clamp(-limit, limit), wire)
            wire = wire.to(self.wire_dtype)
        if not wire.is_contiguous():
            wire = wire.contiguous()
        # bf16 has no numpy dtype: reinterpret as int16 (same bytes) to hand the buffer out.
        view = wire.view(torch.int16) if self.wire_dtype == torch.bfloat16 else wire
        return memoryview(view.numpy()).cast("B")

    def decode(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The bytes copied once into a tensor, then cast (no per-call dtype work: a one-token
        DISPATCH's decode is a few of these)."""
        array = np.frombuffer(data, dtype=WIRE_NUMPY[self.wire_dtype]).reshape(shape)
        tensor = torch.from_numpy(array.copy())
        if self.wire_dtype == torch.bfloat16:  # no numpy bf16: its bytes travel as int16
            tensor = tensor.view(torch.bfloat16)
        return tensor if tensor.dtype == dtype else tensor.to(dtype)


CODECS: dict = {name: RawCodec(name, dtype) for name, dtype in DTYPES.items()}
FLOAT_CODECS = ["f32", "f16", "bf16"] + [c.name for c in BLOCKWISE_CODECS]  # for hidden states
INTEGER_CODECS = ("u8", "i16", "i32", "i64")  # for expert ids


def register_codec(codec) -> None:
    """Add a codec (an object with name, nbytes, encode, decode) to the registry."""
    CODECS[codec.name] = codec


def get_codec(name: str):
    if not isinstance(name, str):
        raise ProtocolError(f"codec name must be a string, got {type(name).__name__}")
    try:
        return CODECS[name]
    except KeyError:
        raise ProtocolError(f"unknown codec {name!r:.80} (known: {', '.join(sorted(CODECS))})") from None


def lossless_codec(dtype: torch.dtype) -> str:
    """The codec that carries `dtype` bit for bit."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"no lossless wire codec for dtype {dtype}") from None


for _codec in BLOCKWISE_CODECS:
    register_codec(_codec)
