"""One GGUF file: validated on open, its metadata, its tensor index and its fingerprint.

`gguf.GGUFReader` memory-maps the file: opening it reads the header only, and a tensor's bytes
are paged in when (and only when) something reads them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from moeswarm.errors import ModelError

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
    reader: GGUFReader = field(repr=False)

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
            reader = GGUFReader(path)
        except Exception as error:  # gguf raises bare ValueError/IndexError on a cut or corrupt header
            raise ModelError(f"{path}: truncated or corrupt GGUF file ({type(error).__name__}: {error})") from None
        size = path.stat().st_size
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise ModelError(
                    f"{path}: truncated: tensor {tensor.name} ends at byte {tensor.data_offset + tensor.n_bytes}, "
                    f"the file has {size} bytes"
                )
        return cls(path, reader)

    # -- metadata ---------------------------------------------------------------------------

    @cached_property
    def metadata(self) -> dict[str, object]:
        """Every key/value field except the reader's own GGUF.* bookkeeping."""
        return {key: _value(f) for key, f in self.reader.fields.items() if not key.startswith("GGUF.")}

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
        return {t.name: t for t in self.reader.tensors}

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
        """The global expert ids a slice file holds; None for a full model file."""
        ids = self.metadata.get(EXPERT_IDS_KEY)
        return [int(i) for i in ids] if ids is not None else None

    @property
    def sliced_layers(self) -> list[int] | None:
        layers = self.metadata.get(LAYERS_KEY)
        return [int(i) for i in layers] if layers is not None else None

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
                digest.update(f"{key}={self.metadata[key]!r}\n".encode())
        for t in self.reader.tensors:
            digest.update(f"{t.name}:{int(t.tensor_type)}:{[int(n) for n in t.shape]}\n".encode())
        data = self.reader.data[self.reader.data_offset :]
        digest.update(str(len(data)).encode())
        digest.update(data[:_SAMPLE_BYTES].tobytes())
        digest.update(data[-_SAMPLE_BYTES:].tobytes())
        return "gguf-" + digest.hexdigest()[:32]


def _value(field):
    """A field's value as plain Python: str, int, float, bool or a list of those."""
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    if field.types == [GGUFValueType.FLOAT32]:
        # Stored as float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal that rounds to
        # the same float32 is what the config held (an epsilon 1 ulp off changes the logits' bits).
        value = float(str(np.float32(value)))
    return value


def type_name(qtype: GGMLQuantizationType | int) -> str:
    return GGMLQuantizationType(int(qtype)).name


__all__ = ["GGUFFile", "type_name", "GGUFValueType"]
