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
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
REPR_CHUNK = 4096  # items per piece when a long list's repr is streamed into a digest

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


class HeaderError(ValueError):
    """The header does not parse (cut short, an unknown type, a key or tensor twice)."""


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
        for _ in range(kv_count):
            key, offset = self._string(offset)
            if key in self.fields:
                raise HeaderError(f"metadata key {key!r} appears twice")
            (kind,), offset = self._unpack("I", offset), offset + 4
            field, offset = self._field(kind, offset)
            self.fields[key] = field
        infos, offset = self._tensor_infos(offset, tensor_count)
        alignment = self._alignment()
        self.data_offset = offset + (-offset % alignment)
        self.tensors = [self._tensor(*info) for info in infos]

    # -- values -----------------------------------------------------------------------------

    def value(self, key: str) -> Any:
        """The value of metadata `key` as plain Python (see the module's docstring)."""
        field = self.fields[key]
        if field.kind == GGUFValueType.ARRAY:
            return self._array(field, 0, field.count)
        value = self._scalar(field.kind, field.offset)
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
            items = self._array(field, start, min(start + REPR_CHUNK, field.count))
            yield (", " if start else "") + ", ".join(map(repr, items))
        yield "]"

    def _array(self, field: Field, start: int, stop: int) -> list:
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
                text, offset = self._string(offset)
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

    def _field(self, kind: int, offset: int) -> tuple[Field, int]:
        """The field of type `kind` at `offset`, and the offset past it."""
        if kind == GGUFValueType.ARRAY:
            (item,), (count,) = self._unpack("I", offset), self._unpack("Q", offset + 4)
            first = offset + 12
            if item in _SCALARS:
                end = first + count * struct.calcsize(_SCALARS[item][0])
            elif item == GGUFValueType.STRING:
                end = first
                for _ in range(count):
                    end = self._skip_string(end)
            else:
                raise HeaderError(f"unknown or unsupported array item type {item}")
            self._need(end)
            return Field(kind, first, item, count), end
        if kind == GGUFValueType.STRING:
            return Field(kind, offset), self._skip_string(offset)
        if kind in _SCALARS:
            end = offset + struct.calcsize(_SCALARS[kind][0])
            self._need(end)
            return Field(kind, offset), end
        raise HeaderError(f"unknown metadata value type {kind}")

    def _tensor_infos(self, offset: int, count: int) -> tuple[list[tuple], int]:
        infos, names = [], set()
        for _ in range(count):
            name, offset = self._string(offset)
            if name in names:
                raise HeaderError(f"tensor {name!r} appears twice")
            names.add(name)
            (n_dims,) = self._unpack("I", offset)
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
        """The tensor as gguf-py's reader gives it: `data` a view of the map in numpy order."""
        ggml_type = GGMLQuantizationType(kind)
        elements = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = elements * type_size // block
        offset = self.data_offset + relative
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

    def _unpack(self, codes: str, offset: int) -> tuple:
        fmt = self._order + codes
        self._need(offset + struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.data, offset)

    def _scalar(self, kind: int, offset: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string(offset)[0]
        return self._unpack(_SCALARS[kind][0], offset)[0]

    def _string(self, offset: int) -> tuple[str, int]:
        end = self._skip_string(offset)
        return str(bytes(self.data[offset + 8 : end]), encoding="utf-8"), end

    def _skip_string(self, offset: int) -> int:
        if offset + 8 > self._size:
            self._need(offset + 8)
        end = offset + 8 + self._length.unpack_from(self.data, offset)[0]
        self._need(end)
        return end

    def _need(self, end: int) -> None:
        if end > self._size:
            raise HeaderError(f"the header runs past the end of the file (byte {end} of {self._size})")
