"""A GGUF file's header, walked once: where each metadata value lies, and the tensor index.

A metadata value is decoded when something asks for it, not when the file is opened. A worker
asks for a few numbers (the architecture's hyperparameters), never for the tokenizer: at a 152k
vocabulary `tokenizer.ggml.tokens`, `.merges` and `.token_type` are ~450k items, which gguf-py's
own `GGUFReader` turns into ~760k numpy objects on open (~200 MB). Walking past them costs one
length read per string.

Values decode to what gguf-py's `ReaderField.contents()` gives (moeswarm's fingerprints were
defined on it): ints, floats (a FLOAT32 array's items as their exact float32 value), bools,
UTF-8 strings, and lists of those. A scalar FLOAT32 becomes the shortest decimal that rounds to
the same float32 (1e-5, not 9.99999974e-06): an epsilon 1 ulp off changes the logits' bits.

The file is hostile until checked: every count is bounded by what the bytes left could hold
before a loop runs on it, every tensor's dims, type and data range are checked before a view is
made (at most MAX_DIMS dims of at least 1, a known type, ne[0] a whole number of blocks, its data
aligned, inside the file and apart from every other tensor's), and keys and tensor names must be UTF-8. A string value that is not
UTF-8 is refused (HeaderError naming its key) when it is decoded. Every refusal is a HeaderError.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

from moeswarm.errors import ModelError

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
REPR_CHUNK = 4096  # items per piece when a long list's repr is streamed into a digest
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 64  # GGML_MAX_NAME: llama.cpp refuses longer tensor names
MAX_KEY_BYTES = 1 << 16
MIN_KV_BYTES = 8 + 4 + 1  # a key's length, its value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # a name's length, n_dims, one dim, type, offset

_SCALARS: dict[int, tuple[str, type | None]] = {  # value type -> (struct code, numpy type)
    GGUFValueType.UINT8: ("B", np.uint8), GGUFValueType.INT8: ("b", np.int8),
    GGUFValueType.UINT16: ("H", np.uint16), GGUFValueType.INT16: ("h", np.int16),
    GGUFValueType.UINT32: ("I", np.uint32), GGUFValueType.INT32: ("i", np.int32),
    GGUFValueType.FLOAT32: ("f", np.float32), GGUFValueType.BOOL: ("?", np.bool_),
    GGUFValueType.UINT64: ("Q", np.uint64), GGUFValueType.INT64: ("q", np.int64),
    GGUFValueType.FLOAT64: ("d", np.float64),
}
_PLAIN_TENSORS = {  # ggml types whose data view has the tensor's own element type (others: raw bytes)
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class HeaderError(ModelError, ValueError):
    """The header does not parse or does not hold (cut short, a count or dim out of bounds, an
    unknown type, a key or tensor twice, a string not UTF-8): its message names the field."""


@dataclass(frozen=True)
class Field:
    """Where one metadata value lies: its type (`item` for an array's items), and for an array its
    item count and the offset of its first item; for a scalar or string, the value's offset."""

    kind: int
    offset: int
    item: int | None = None
    count: int = 1


class GGUFHeader:
    """The parsed header of the memory-mapped file `data` (a uint8 np.memmap)."""

    def __init__(self, data: np.ndarray):
        self.data = data
        self._size = len(data)
        self.fields: dict[str, Field] = {}
        offset = self._parse_preamble()
        tensor_count, kv_count = self._unpack("QQ", offset)
        offset += 16
        self._bound("kv_count", kv_count, offset, MIN_KV_BYTES)
        for _ in range(kv_count):
            key, offset = self._string(offset, "a metadata key", MAX_KEY_BYTES)
            if key in self.fields:
                raise HeaderError(f"metadata key {key!r} appears twice")
            (kind,), offset = self._unpack("I", offset), offset + 4
            field, offset = self._field(key, kind, offset)
            self.fields[key] = field
        self._bound("tensor_count", tensor_count, offset, MIN_TENSOR_INFO_BYTES)
        infos, offset = self._tensor_infos(offset, tensor_count)
        self.alignment = self._alignment()
        self.data_offset = offset + (-offset % self.alignment)
        self.tensors = [self._tensor(*info) for info in infos]
        self._check_disjoint()

    # -- values -----------------------------------------------------------------------------

    def value(self, key: str) -> Any:
        """The value of metadata `key` as plain Python (see the module's docstring)."""
        field = self.fields[key]
        if field.kind == GGUFValueType.ARRAY:
            return self._array(field, 0, field.count, key)
        value = self._scalar(field.kind, field.offset, f"metadata {key}")
        if field.kind == GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))
        return value

    def length(self, key: str) -> int | None:
        """The item count of array `key` without decoding it (None: not an array)."""
        field = self.fields[key]
        return field.count if field.kind == GGUFValueType.ARRAY else None

    def repr_pieces(self, key: str) -> Iterator[str]:
        """`repr(self.value(key))` in pieces, a long array a chunk of items at a time (never whole)."""
        field = self.fields[key]
        if field.kind != GGUFValueType.ARRAY or field.count <= REPR_CHUNK:
            yield repr(self.value(key))
            return
        yield "["
        for start in range(0, field.count, REPR_CHUNK):
            items = self._array(field, start, min(start + REPR_CHUNK, field.count), key)
            yield (", " if start else "") + ", ".join(map(repr, items))
        yield "]"

    def _array(self, field: Field, start: int, stop: int, key: str) -> list:
        """Items [start, stop) of an array field."""
        if field.item in _SCALARS:
            code, np_type = _SCALARS[field.item]
            size = struct.calcsize(code)
            view = self.data[field.offset + start * size : field.offset + stop * size].view(np_type)
            return view.view(view.dtype.newbyteorder(self._order)).tolist()
        if field.item == GGUFValueType.STRING:
            offset = field.offset
            for _ in range(start):
                offset = self._skip_string(offset)
            items = []
            for _ in range(start, stop):
                text, offset = self._string(offset, f"metadata {key}")
                items.append(text)
            return items
        raise HeaderError(f"arrays of {GGUFValueType(field.item).name} are not supported")

    # -- parsing ----------------------------------------------------------------------------

    def _parse_preamble(self) -> int:
        if self._size < 24 or bytes(self.data[:4]) != b"GGUF":
            raise HeaderError("GGUF magic invalid or header cut short")
        self._order = "<"
        (version,) = self._unpack("I", 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            (version,) = self._unpack("I", 4)
        self._length = struct.Struct(self._order + "Q")  # a string's length: read once per string
        if version not in SUPPORTED_VERSIONS:
            raise HeaderError(f"GGUF version {version} is not supported ({', '.join(map(str, SUPPORTED_VERSIONS))})")
        return 8

    def _field(self, key: str, kind: int, offset: int) -> tuple[Field, int]:
        """The field of type `kind` at `offset`, and the offset past it."""
        if kind == GGUFValueType.ARRAY:
            (item,), (count,) = self._unpack("I", offset), self._unpack("Q", offset + 4)
            first = offset + 12
            self._bound(f"metadata {key}: array count", count, first, 8 if item == GGUFValueType.STRING else 1)
            if item in _SCALARS:
                end = first + count * struct.calcsize(_SCALARS[item][0])
            elif item == GGUFValueType.STRING:
                end = first
                for _ in range(count):
                    end = self._skip_string(end)
            else:
                raise HeaderError(f"metadata {key}: unknown or unsupported array item type {item}")
            self._need(end)
            return Field(kind, first, item, count), end
        if kind == GGUFValueType.STRING:
            return Field(kind, offset), self._skip_string(offset)
        if kind in _SCALARS:
            end = offset + struct.calcsize(_SCALARS[kind][0])
            self._need(end)
            return Field(kind, offset), end
        raise HeaderError(f"metadata {key}: unknown value type {kind}")

    def _tensor_infos(self, offset: int, count: int) -> tuple[list[tuple], int]:
        infos, names = [], set()
        for _ in range(count):
            name, offset = self._string(offset, "a tensor name", MAX_NAME_BYTES)
            if name in names:
                raise HeaderError(f"tensor {name!r} appears twice")
            names.add(name)
            (n_dims,) = self._unpack("I", offset)
            if not 1 <= n_dims <= MAX_DIMS:
                raise HeaderError(f"tensor {name!r}: n_dims {n_dims} is not 1-{MAX_DIMS}")
            dims = self._unpack(f"{n_dims}Q", offset + 4)
            offset += 4 + 8 * n_dims
            kind, data_offset = self._unpack("IQ", offset)  # standard sizes: no padding between them
            offset += 12
            infos.append((name, dims, kind, data_offset))
        return infos, offset

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.kind != GGUFValueType.UINT32:
            raise HeaderError("bad type for general.alignment")
        alignment = self._scalar(field.kind, field.offset)
        if alignment == 0 or alignment & (alignment - 1):
            raise HeaderError(f"invalid alignment {alignment}: must be a non-zero power of two")
        return alignment

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, relative: int) -> ReaderTensor:
        """The tensor as gguf-py's reader gives it: `data` a view of the map in numpy order, made only
        once its type, dims and data range have been checked against the file."""
        try:
            ggml_type = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise HeaderError(f"tensor {name!r}: unknown ggml type {kind}") from None
        if min(dims) < 1:
            raise HeaderError(f"tensor {name!r}: a dimension is 0 (ne {list(dims)})")
        if dims[0] % block:
            raise HeaderError(f"tensor {name!r}: ne[0] {dims[0]} is not a whole number of {ggml_type.name} blocks of {block}")
        elements = math.prod(dims)  # Python ints: no overflow; bounded by the file's size below
        n_bytes = elements * type_size // block
        if relative % self.alignment:
            raise HeaderError(f"tensor {name!r}: data offset {relative} is not a multiple of the alignment {self.alignment}")
        offset = self.data_offset + relative
        if offset + n_bytes > self._size:
            raise HeaderError(f"tensor {name!r}: its data (ne {list(dims)}, {ggml_type.name}, {n_bytes} bytes at byte "
                              f"{offset}) runs past the end of the file ({self._size} bytes)")
        np_dims = tuple(reversed(dims))
        item_type = _PLAIN_TENSORS.get(ggml_type)
        if item_type is None:
            item_type, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, ggml_type)
        count = n_bytes if item_type is np.uint8 else elements
        end = offset + count * np.dtype(item_type).itemsize
        view = self.data[offset:end].view(item_type)[:count]
        view = view.view(view.dtype.newbyteorder(self._order)).reshape(np_dims)
        return ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
                            n_elements=elements, n_bytes=n_bytes, data_offset=offset, data=view, field=None)

    def _check_disjoint(self) -> None:
        """No two tensors' data overlap (llama.cpp requires them back to back): each byte means one thing."""
        spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in self.tensors)
        for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
            if start < end:
                raise HeaderError(f"tensor {following!r}: its data overlaps tensor {name!r}'s")

    def _unpack(self, codes: str, offset: int) -> tuple:
        fmt = self._order + codes
        self._need(offset + struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.data, offset)

    def _scalar(self, kind: int, offset: int, key: str = "") -> Any:
        if kind == GGUFValueType.STRING:
            return self._string(offset, key)[0]
        return self._unpack(_SCALARS[kind][0], offset)[0]

    def _string(self, offset: int, what: str, limit: int | None = None) -> tuple[str, int]:
        """The string at `offset` (`what` names it in errors; `limit`: most bytes), and the offset past it."""
        end = self._skip_string(offset)
        if limit is not None and end - offset - 8 > limit:
            raise HeaderError(f"{what} at byte {offset} is {end - offset - 8} bytes long (at most {limit})")
        try:
            return str(bytes(self.data[offset + 8 : end]), encoding="utf-8"), end
        except UnicodeDecodeError as error:
            raise HeaderError(f"{what}: the string at byte {offset} is not valid UTF-8 ({error.reason} at byte "
                              f"{offset + 8 + error.start})") from None

    def _bound(self, what: str, count: int, offset: int, min_bytes: int) -> None:
        """Refuse a count whose items (at least `min_bytes` each) could not fit in the bytes left."""
        if count * min_bytes > self._size - offset:
            raise HeaderError(f"{what} {count} at byte {offset} cannot fit in the {self._size - offset} bytes left")

    def _skip_string(self, offset: int) -> int:
        if offset + 8 > self._size:
            self._need(offset + 8)
        end = offset + 8 + self._length.unpack_from(self.data, offset)[0]
        self._need(end)
        return end

    def _need(self, end: int) -> None:
        if end > self._size:
            raise HeaderError(f"the header runs past the end of the file (byte {end} of {self._size})")
