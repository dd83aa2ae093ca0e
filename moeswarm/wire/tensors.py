"""Packing named tensors into a frame: descriptors in the metadata, bytes in the payload.

Each descriptor is a 4-item list `[name, codec, dtype, shape]` (a list, not a map: on a decode
step of a reduced wire every byte of metadata counts); the payload is the codecs' bytes
concatenated in descriptor order. On receipt every field is checked before any byte is read:
known codec and dtype, a shape of positive ints (no empty tensor), and lengths that add up to the
payload.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moeswarm.errors import ProtocolError
from moeswarm.wire.codecs import DTYPE_NAMES, DTYPES, MAX_RANK, WIRE_NUMPY, RawCodec, get_codec

Descriptor = list[Any]
MAX_TENSORS = 8  # a message carries at most 3
_MAX_DIM = 1 << 31


def pack(tensors: list[tuple[str, torch.Tensor | np.ndarray, str]]) -> tuple[list[Descriptor], list[memoryview]]:
    """[(name, tensor, codec)] -> (descriptors, payload buffers).

    A numpy array stands for an integer tensor already in its codec's dtype (expert ids compacted
    in numpy): its bytes go as they are, without a round trip through torch."""
    descriptors, buffers = [], []
    for name, tensor, codec_name in tensors:
        if isinstance(tensor, np.ndarray):
            descriptors.append([name, codec_name, codec_name, list(tensor.shape)])
            buffers.append(memoryview(np.ascontiguousarray(tensor, WIRE_NUMPY[DTYPES[codec_name]])).cast("B"))
            continue
        codec = get_codec(codec_name)
        descriptors.append([name, codec_name, DTYPE_NAMES[tensor.dtype], list(tensor.shape)])
        buffers.append(codec.encode(tensor))
    return descriptors, buffers


def unpack(descriptors: Any, payload: memoryview | bytes, raw: str | None = None) -> dict[str, torch.Tensor | np.ndarray]:
    """Decode a frame's tensors; raise ProtocolError naming the first field that does not fit.

    raw: the name of a tensor to return as its wire bytes viewed as a read-only numpy array (when it
    travels in a raw codec), for a caller that converts it itself (expert ids: one numpy step to int64)."""
    if not isinstance(descriptors, list):
        raise ProtocolError("metadata field 'tensors' must be a list")
    if len(descriptors) > MAX_TENSORS:
        raise ProtocolError(f"frame describes {len(descriptors)} tensors, over the limit of {MAX_TENSORS}")
    payload = memoryview(payload)
    offset, out, seen = 0, {}, set()
    for index, desc in enumerate(descriptors):
        name, codec, dtype, shape = _check_descriptor(index, desc, seen)
        size = codec.nbytes(shape)
        if offset + size > len(payload):
            raise ProtocolError(
                f"tensor {name!r}: shape {list(shape)} with codec {codec.name} needs {size} bytes, "
                f"payload has {len(payload) - offset} left"
            )
        data = payload[offset : offset + size]
        if name == raw and type(codec) is RawCodec and codec.wire_dtype != torch.bfloat16:
            out[name] = np.frombuffer(data, dtype=WIRE_NUMPY[codec.wire_dtype]).reshape(shape)
        else:
            out[name] = codec.decode(data, shape, dtype)
        offset += size
    if offset != len(payload):
        raise ProtocolError(f"payload has {len(payload) - offset} bytes beyond its tensors' sizes")
    return out


def located(descriptors: list[Descriptor]) -> dict[str, tuple[int, int, Any, torch.dtype, tuple[int, ...]]]:
    """{name: (offset, size, codec, dtype, shape)} of descriptors `unpack` has accepted: where each
    tensor lies in the payload (wire/layouts.py keeps it for the next frame with the same metadata)."""
    offset, found = 0, {}
    for index, desc in enumerate(descriptors):
        name, codec, dtype, shape = _check_descriptor(index, desc, set())
        size = codec.nbytes(shape)
        found.setdefault(name, (offset, size, codec, dtype, shape))
        offset += size
    return found


def raw_numpy(codec) -> np.dtype:
    """The numpy dtype of a raw codec's wire bytes (little-endian; bf16 as int16)."""
    return WIRE_NUMPY[codec.wire_dtype]


def _check_descriptor(index: int, desc: Any, seen: set[str]):
    if not isinstance(desc, list) or len(desc) != 4:
        raise ProtocolError(f"tensor descriptor {index} must be a list [name, codec, dtype, shape]")
    name, codec_name, dtype_name, shape = desc
    if not isinstance(name, str):
        raise ProtocolError(f"tensor descriptor {index} has no string name")
    if name in seen:
        raise ProtocolError(f"tensor {name!r:.80} is described twice")
    seen.add(name)
    codec = get_codec(codec_name)
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ProtocolError(f"tensor {name!r:.80}: unknown dtype {dtype_name!r:.80} (known: {', '.join(DTYPES)})")
    if (
        type(shape) is not list
        or len(shape) > MAX_RANK
        or not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape)  # type(): a bool is no dimension
    ):
        raise ProtocolError(f"tensor {name!r}: bad shape {shape!r:.200}")
    if 0 in shape:
        # Nothing in the protocol is empty (a DISPATCH has >= 1 token, a RESULT >= 1 row), and an
        # empty tensor's other dims would reach the experts unchecked by any byte count.
        raise ProtocolError(f"tensor {name!r}: shape {shape} has no elements")
    return name, codec, DTYPES[dtype_name], tuple(shape)
