"""A Hugging Face model directory: config, safetensors shards (lazily opened) and fingerprint."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from moeswarm.errors import ModelError

_SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True)
class Checkpoint:
    """A model directory with config.json and *.safetensors files."""

    path: Path

    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        """A model directory; a `.gguf` path gives its sibling, weights.gguf_model.GGUFCheckpoint."""
        path = Path(path)
        if path.suffix.lower() == ".gguf":
            from moeswarm.weights.gguf_model import GGUFCheckpoint

            return GGUFCheckpoint.open(path)
        if not path.is_dir():
            raise ModelError(f"{path}: not a model directory (expected config.json and *.safetensors)")
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: no config.json")
        if not list(path.glob("*.safetensors")):
            raise ModelError(f"{path}: no *.safetensors weights")
        return cls(path)

    @cached_property
    def config(self) -> PretrainedConfig:
        try:
            return AutoConfig.from_pretrained(self.path)
        except Exception as error:
            raise ModelError(f"{self.path}/config.json: {error}") from None

    @cached_property
    def shards(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    def open_tensors(self) -> dict[str, object]:
        """{checkpoint key: lazy slice}; nothing is read until a slice is indexed."""
        slices: dict[str, object] = {}
        for shard in self.shards:
            handle = safe_open(str(shard), framework="pt", device="cpu")
            for key in handle.keys():
                slices[key] = handle.get_slice(key)
        return slices

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the config and the weights, cheap enough for models of hundreds of GB.

        It covers config.json, every shard's safetensors header (names, dtypes, shapes, offsets),
        its size, and the first and last 64 KiB of its data: a different model, a fine-tune or a
        re-quantization changes it; reading whole shards would take minutes on a large model.
        """
        digest = hashlib.sha256()
        config = json.loads((self.path / "config.json").read_text())
        for volatile in ("transformers_version", "_name_or_path", "architectures"):
            config.pop(volatile, None)
        digest.update(json.dumps(config, sort_keys=True).encode())
        for shard in self.shards:
            size = shard.stat().st_size
            with shard.open("rb") as handle:
                header_len = struct.unpack("<Q", handle.read(8))[0]
                digest.update(handle.read(header_len))
                digest.update(struct.pack("<Q", size))
                digest.update(handle.read(_SAMPLE_BYTES))
                handle.seek(max(8 + header_len, size - _SAMPLE_BYTES))
                digest.update(handle.read(_SAMPLE_BYTES))
        return "hf-" + digest.hexdigest()[:32]
