"""Mutated GGUF files for the file fuzzer: one header field, tensor entry or byte range changed.

`Layout` walks a valid GGUF file's header and records where each piece lies (counts, each
metadata value, each tensor's dims, type and offset); `mutate` picks one mutation with a seeded
`random.Random` and returns the new bytes and a one-line description. The mutations aim at what
a loader trusts: counts (tensor, key/value, array lengths), hyperparameters (block_count,
expert_count, head counts, embedding_length...), tensor dimensions, types and offsets, string
bytes (invalid UTF-8), the tokenizer's lists, truncation, and random byte flips in the header.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

from gguf import GGMLQuantizationType, GGUFValueType

INTS = [0, 1, 2, 3, 7, 100000, 2**20, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]
FLOATS = [float("nan"), float("inf"), -1.0, 0.0, 1e30, 1e-30]
_SCALAR_CODES = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_TYPES = [t.value for t in GGMLQuantizationType] + [4, 5, 99, 2**31]  # known ones, removed ones (4, 5) and nonsense


@dataclass(frozen=True)
class KeyValue:
    key: str
    kind_at: int  # offset of the value type (uint32)
    kind: int
    value_at: int  # scalar: the value; string: its length; array: its item type (then count, then items)
    item: int | None = None
    count: int = 1
    items_at: int = 0  # array: the first item


@dataclass(frozen=True)
class TensorEntry:
    name: str
    n_dims_at: int
    dims: tuple[int, ...]
    type_at: int
    offset_at: int


class Layout:
    """Where each piece of a little-endian GGUF v3 file's header lies."""

    def __init__(self, data: bytes):
        self.data = data
        self.tensor_count_at, self.kv_count_at = 8, 16
        tensors, kvs = struct.unpack_from("<QQ", data, 8)
        at = 24
        self.kvs: list[KeyValue] = []
        for _ in range(kvs):
            key, at = self._string(at)
            kind_at = at
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4
            if kind == GGUFValueType.ARRAY:
                item, count = struct.unpack_from("<IQ", data, at)
                self.kvs.append(KeyValue(key, kind_at, kind, at, item, count, at + 12))
                at += 12
                for _ in range(count):
                    at = self._skip(item, at)
            else:
                self.kvs.append(KeyValue(key, kind_at, kind, at))
                at = self._skip(kind, at)
        self.tensors: list[TensorEntry] = []
        for _ in range(tensors):
            name, at = self._string(at)
            (n_dims,) = struct.unpack_from("<I", data, at)
            dims = struct.unpack_from(f"<{n_dims}Q", data, at + 4)
            type_at = at + 4 + 8 * n_dims
            self.tensors.append(TensorEntry(name, at, dims, type_at, type_at + 4))
            at = type_at + 12
        self.header_end = at

    def _string(self, at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self.data, at)
        return self.data[at + 8 : at + 8 + length].decode(), at + 8 + length

    def _skip(self, kind: int, at: int) -> int:
        if kind == GGUFValueType.STRING:
            return self._string(at)[1]
        return at + struct.calcsize(_SCALAR_CODES[kind])


def _put(data: bytearray, at: int, code: str, value) -> None:
    try:
        struct.pack_into("<" + code, data, at, value)
    except struct.error:  # out of the code's range: the value's low bits, as a C cast would write them
        size = struct.calcsize(code)
        data[at : at + size] = (int(value) & ((1 << 8 * size) - 1)).to_bytes(size, "little")


def mutate(base: bytes, layout: Layout, rng: random.Random) -> tuple[bytes, str]:
    """One mutation of `base`, and what it changed (one line)."""
    return _apply(rng.choice(_MUTATIONS), bytearray(base), layout, rng)


def _apply(kind, data: bytearray, layout: Layout, rng: random.Random) -> tuple[bytes, str]:
    what = kind(data, layout, rng)
    if isinstance(what, tuple):  # a truncation: (new length, description)
        return bytes(data[: what[0]]), what[1]
    return bytes(data), what


def _int_value(data: bytearray, layout: Layout, rng: random.Random) -> str:
    kv = rng.choice([kv for kv in layout.kvs if kv.kind in _SCALAR_CODES and kv.kind not in (6, 12, 7)])
    value = rng.choice(INTS)
    _put(data, kv.value_at, _SCALAR_CODES[kv.kind], value)
    return f"{kv.key} = {value}"


def _float_value(data: bytearray, layout: Layout, rng: random.Random) -> str:
    kv = rng.choice([kv for kv in layout.kvs if kv.kind == GGUFValueType.FLOAT32])
    value = rng.choice(FLOATS)
    _put(data, kv.value_at, "f", value)
    return f"{kv.key} = {value}"


def _value_type(data: bytearray, layout: Layout, rng: random.Random) -> str:
    kv = rng.choice(layout.kvs)
    kind = rng.choice([*list(_SCALAR_CODES), GGUFValueType.STRING, GGUFValueType.ARRAY, 13, 2**31])
    _put(data, kv.kind_at, "I", kind)
    return f"{kv.key}: value type {kv.kind} -> {kind}"


def _string_bytes(data: bytearray, layout: Layout, rng: random.Random) -> str:
    strings = [kv for kv in layout.kvs if kv.kind == GGUFValueType.STRING]
    kv = rng.choice(strings)
    (length,) = struct.unpack_from("<Q", data, kv.value_at)
    if length and rng.random() < 0.6:
        at = kv.value_at + 8 + rng.randrange(length)
        data[at] = rng.choice([0xFF, 0xC0, 0x80, 0xED])
        return f"{kv.key}: byte {at} not UTF-8"
    value = rng.choice(INTS)
    _put(data, kv.value_at, "Q", value)
    return f"{kv.key}: string length {value}"


def _array(data: bytearray, layout: Layout, rng: random.Random) -> str:
    kv = rng.choice([kv for kv in layout.kvs if kv.kind == GGUFValueType.ARRAY])
    choice = rng.random()
    if choice < 0.4:
        value = rng.choice(INTS + [kv.count - 1, kv.count + 1, kv.count // 2])
        _put(data, kv.value_at + 4, "Q", value)
        return f"{kv.key}: array count {kv.count} -> {value}"
    if choice < 0.6:
        item = rng.choice([*list(_SCALAR_CODES), GGUFValueType.STRING, GGUFValueType.ARRAY, 13])
        _put(data, kv.value_at, "I", item)
        return f"{kv.key}: item type {kv.item} -> {item}"
    if kv.item != GGUFValueType.STRING:  # an item's value
        index = rng.randrange(kv.count)
        code = _SCALAR_CODES[kv.item]
        value = rng.choice(INTS if code not in "fd" else FLOATS)
        _put(data, kv.items_at + index * struct.calcsize(code), code, value)
        return f"{kv.key}[{index}] = {value}"
    at, index = kv.items_at, rng.randrange(kv.count)
    for _ in range(index):
        at += 8 + struct.unpack_from("<Q", data, at)[0]
    (length,) = struct.unpack_from("<Q", data, at)
    if length and rng.random() < 0.7:  # a string item's bytes: invalid UTF-8, or a space (a merge of 3 parts)
        spot = at + 8 + rng.randrange(length)
        data[spot] = rng.choice([0xFF, 0x80, 0x20, 0x41])
        return f"{kv.key}[{index}]: byte {spot} -> {data[spot]:#x}"
    value = rng.choice(INTS)
    _put(data, at, "Q", value)
    return f"{kv.key}[{index}]: string length {value}"


def _tensor_dim(data: bytearray, layout: Layout, rng: random.Random) -> str:
    tensor = rng.choice(layout.tensors)
    axis = rng.randrange(len(tensor.dims))
    old = tensor.dims[axis]
    value = rng.choice(INTS + [old // 2, old * 2, old - 1, old + 1, 2**40, 2**62])
    _put(data, tensor.n_dims_at + 4 + 8 * axis, "Q", value)
    return f"{tensor.name}: ne[{axis}] {old} -> {value}"


def _tensor_n_dims(data: bytearray, layout: Layout, rng: random.Random) -> str:
    tensor = rng.choice(layout.tensors)
    value = rng.choice([0, 1, 2, 3, 4, 5, 2**31, 2**32 - 1])
    _put(data, tensor.n_dims_at, "I", value)
    return f"{tensor.name}: n_dims {len(tensor.dims)} -> {value}"


def _tensor_type(data: bytearray, layout: Layout, rng: random.Random) -> str:
    tensor = rng.choice(layout.tensors)
    value = rng.choice(_TYPES)
    _put(data, tensor.type_at, "I", value)
    return f"{tensor.name}: type -> {value}"


def _tensor_offset(data: bytearray, layout: Layout, rng: random.Random) -> str:
    tensor = rng.choice(layout.tensors)
    (old,) = struct.unpack_from("<Q", data, tensor.offset_at)
    value = rng.choice([0, 1, old + 1, old + 32, old - 32, len(data), 2**40, 2**63, 2**64 - 1])
    _put(data, tensor.offset_at, "Q", value)
    return f"{tensor.name}: offset {old} -> {value}"


def _counts(data: bytearray, layout: Layout, rng: random.Random) -> str:
    at, name = rng.choice([(layout.tensor_count_at, "tensor_count"), (layout.kv_count_at, "kv_count")])
    (old,) = struct.unpack_from("<Q", data, at)
    value = rng.choice(INTS + [old - 1, old + 1])
    _put(data, at, "Q", value)
    return f"{name} {old} -> {value}"


def _truncate(data: bytearray, layout: Layout, rng: random.Random) -> tuple[int, str]:
    end = rng.choice([rng.randrange(layout.header_end), rng.randrange(layout.header_end, len(data))])
    return end, f"truncated to {end} bytes"


def _flip(data: bytearray, layout: Layout, rng: random.Random) -> str:
    spots = [rng.randrange(8, layout.header_end) for _ in range(rng.randint(1, 4))]
    for spot in spots:
        data[spot] = rng.randrange(256)
    return f"header bytes {spots} randomised"


_MUTATIONS = [_int_value, _int_value, _int_value, _float_value, _value_type, _string_bytes, _array, _array,
              _tensor_dim, _tensor_dim, _tensor_dim, _tensor_n_dims, _tensor_type, _tensor_type, _tensor_offset,
              _counts, _truncate, _flip]


# -- named mutations (the tests' reproductions of known findings) -------------------------------


def _kv(layout: Layout, key: str) -> KeyValue:
    return next(kv for kv in layout.kvs if kv.key == key)


def _tensor(layout: Layout, name: str) -> TensorEntry:
    return next(t for t in layout.tensors if t.name == name)


def with_int(layout: Layout, key: str, value: int) -> bytes:
    """The file with scalar metadata `key` (an integer type) set to `value` (its low bits)."""
    data, kv = bytearray(layout.data), _kv(layout, key)
    _put(data, kv.value_at, _SCALAR_CODES[kv.kind], value)
    return bytes(data)


def with_dim(layout: Layout, name: str, axis: int, value: int) -> bytes:
    """The file with tensor `name`'s ne[axis] set to `value`."""
    data, tensor = bytearray(layout.data), _tensor(layout, name)
    _put(data, tensor.n_dims_at + 4 + 8 * axis, "Q", value)
    return bytes(data)


def with_type(layout: Layout, name: str, ggml_type: int) -> bytes:
    """The file with tensor `name`'s ggml type set to `ggml_type`."""
    data = bytearray(layout.data)
    _put(data, _tensor(layout, name).type_at, "I", ggml_type)
    return bytes(data)


def with_string_byte(layout: Layout, key: str, index: int, byte: int) -> bytes:
    """The file with byte `index` of string metadata `key` set to `byte` (0xFF: not UTF-8)."""
    data, kv = bytearray(layout.data), _kv(layout, key)
    data[kv.value_at + 8 + index] = byte
    return bytes(data)


def with_array_string_byte(layout: Layout, key: str, item: int, index: int, byte: int) -> bytes:
    """The file with byte `index` of item `item` of string array `key` set to `byte`."""
    data, kv = bytearray(layout.data), _kv(layout, key)
    at = kv.items_at
    for _ in range(item):
        at += 8 + struct.unpack_from("<Q", data, at)[0]
    data[at + 8 + index] = byte
    return bytes(data)
