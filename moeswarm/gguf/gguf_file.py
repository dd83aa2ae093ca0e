"""One GGUF file: validated on open, its metadata, its tensor index and its fingerprint.

The file is memory-mapped: opening it walks the header (gguf/gguf_header.py), and a tensor's
bytes are paged in when (and only when) something reads them. A metadata value is decoded when
asked for: a worker, which never asks for the tokenizer, holds none of its vocabulary-sized lists.
gguf-py's own `GGUFReader` (`reader`, for what needs its field objects: slicing, the manifest)
is built on first use only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from moeswarm.errors import ModelError
from moeswarm.gguf.gguf_bounds import check_model
from moeswarm.gguf.gguf_header import GGUFHeader, HeaderError

GGUF_MAGIC = b"GGUF"
SLICE_PREFIX = "moeswarm."  # metadata keys a slice file adds; never part of the fingerprint
FINGERPRINT_KEY = "moeswarm.fingerprint"
EXPERT_FIRST_KEY = "moeswarm.expert_first"
EXPERT_IDS_KEY = "moeswarm.expert_ids"
LAYERS_KEY = "moeswarm.layers"
_SAMPLE_BYTES = 1 << 16


@dataclass(eq=False)
class GGUFFile:
    """A validated GGUF file. `tensors` maps each tensor name to its memory-mapped view."""

    path: Path
    header: GGUFHeader = field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"{path}: no such GGUF file")
        with path.open("rb") as handle:
            magic = handle.read(4)
        if magic != GGUF_MAGIC:
            raise ModelError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            header = GGUFHeader(np.memmap(path, mode="r"))
        except HeaderError as error:  # every tensor's data lies inside the file once this passes
            raise ModelError(f"{path}: truncated or corrupt GGUF file ({error})") from None
        except (ValueError, OverflowError, IndexError) as error:  # a case the header's checks missed: still one line
            raise ModelError(f"{path}: truncated or corrupt GGUF file ({type(error).__name__}: {error})") from None
        opened = cls(path, header)
        check_model(opened)  # the metadata against its bounds and the tensors (gguf_bounds.py)
        return opened

    @cached_property
    def reader(self) -> GGUFReader:
        """gguf-py's reader of the file (its field objects; every value parsed): built on first use."""
        return GGUFReader(self.path)

    # -- metadata ---------------------------------------------------------------------------

    @cached_property
    def metadata(self) -> Mapping[str, object]:
        """Every key/value field, each decoded when read (a read-only mapping, in file order)."""
        return _Metadata(self.header, self.path)

    def metadata_length(self, key: str) -> int | None:
        """The item count of an array field without decoding it; None when absent or not an array."""
        return self.header.length(key) if key in self.header.fields else None

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelError(f"{self.path}: no general.architecture in the GGUF metadata")
        return arch

    def get(self, key: str, default=None):
        """`{arch}.{key}` from the metadata (the per-architecture hyperparameters)."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    # -- tensors ----------------------------------------------------------------------------

    @cached_property
    def tensors(self) -> dict[str, ReaderTensor]:
        return {t.name: t for t in self.header.tensors}

    def tensor(self, name: str) -> ReaderTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: no tensor {name}") from None

    # -- slice files --------------------------------------------------------------------------

    @property
    def is_slice(self) -> bool:
        return FINGERPRINT_KEY in self.metadata

    @property
    def expert_first(self) -> int:
        """Global id of the first expert stored along ne[2] (0 in a full file); `expert_ids` says which all are."""
        return int(self.metadata.get(EXPERT_FIRST_KEY, 0))

    @property
    def expert_ids(self) -> list[int] | None:
        """The global expert ids a slice file holds ([] for a backbone slice); None for a full model file."""
        ids = self.metadata.get(EXPERT_IDS_KEY)
        if ids is None:
            return [] if self.is_slice else None
        return [int(i) for i in ids]

    @property
    def sliced_layers(self) -> list[int] | None:
        """The MoE layers whose experts a slice file holds ([] for a backbone slice); None for a full file."""
        layers = self.metadata.get(LAYERS_KEY)
        if layers is None:
            return [] if self.is_slice else None
        return [int(i) for i in layers]

    # -- identity -----------------------------------------------------------------------------

    @cached_property
    def fingerprint(self) -> str:
        """The model's identity; a slice file carries the fingerprint of the file it was cut from.

        Defined on a full file as sha256 over: every metadata key and value (sorted by key,
        moeswarm.* keys excluded), every tensor's name, type and shape (ne) in file order, the
        tensor data region's size, and its first and last 64 KiB. A re-quantization, a fine-tune
        or another model changes it; computing it reads 128 KiB of data whatever the model's size.
        """
        if self.is_slice:
            return str(self.metadata[FINGERPRINT_KEY])
        digest = hashlib.sha256()
        for key in sorted(self.metadata):
            if not key.startswith(SLICE_PREFIX):
                # f"{key}={value!r}\n", a long list streamed: the vocabulary is never held whole
                digest.update(f"{key}=".encode())
                try:
                    for piece in self.header.repr_pieces(key):
                        digest.update(piece.encode())
                except HeaderError as error:  # a string that is not UTF-8
                    raise ModelError(f"{self.path}: {error}") from None
                digest.update(b"\n")
        for t in self.header.tensors:
            digest.update(f"{t.name}:{int(t.tensor_type)}:{[int(n) for n in t.shape]}\n".encode())
        data = self.header.data[self.header.data_offset :]
        digest.update(str(len(data)).encode())
        digest.update(data[:_SAMPLE_BYTES].tobytes())
        digest.update(data[-_SAMPLE_BYTES:].tobytes())
        return "gguf-" + digest.hexdigest()[:32]


class _Metadata(Mapping):
    """A GGUF file's metadata, read-only: each value decoded from the map when read, never kept."""

    def __init__(self, header: GGUFHeader, path: Path):
        self._header = header
        self._path = path

    def __getitem__(self, key: str) -> object:
        if key not in self._header.fields:
            raise KeyError(key)
        try:
            return self._header.value(key)
        except HeaderError as error:  # a string that is not UTF-8: one line naming the file and the key
            raise ModelError(f"{self._path}: {error}") from None

    def __contains__(self, key: object) -> bool:
        return key in self._header.fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._header.fields)

    def __len__(self) -> int:
        return len(self._header.fields)


def type_name(qtype: GGMLQuantizationType | int) -> str:
    return GGMLQuantizationType(int(qtype)).name


__all__ = ["GGUFFile", "type_name", "GGUFValueType"]
