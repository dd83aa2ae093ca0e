"""A Hugging Face model directory as a model source: config, safetensors shards, fingerprint.

It implements moeswarm.sources.source.ModelSource: the backbone and any set of experts are loaded
through transformers' own loader (moeswarm.sources.hf_tensors), reading only the tensors (and, in
fused expert tensors, only the rows) that are asked for.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar

from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from moeswarm.errors import ModelError
from moeswarm.ids import LayerId, runs
from moeswarm.sources.hf_tensors import Rows, load_tensors
from moeswarm.kernels.row_ops import use_rotary_tables

_SAMPLE_BYTES = 1 << 16
_PER_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Checkpoint:
    """A model directory with config.json and *.safetensors files."""

    path: Path
    kind: ClassVar[str] = "hf"
    held_layers: ClassVar[frozenset[int] | None] = None  # a directory holds every layer...
    held_experts: ClassVar[tuple[int, ...] | None] = None  # ...and every expert

    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        path = Path(path)
        if not path.exists():
            raise ModelError(f"{path}: not a model directory (nothing at that path)")
        if not path.is_dir():
            raise ModelError(f"{path}: not a model directory (expected config.json and *.safetensors, or a .gguf file)")
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

    # -- ModelSource --------------------------------------------------------------------------

    def load_backbone(self, model: PreTrainedModel, skip: set[str]) -> None:
        """Every parameter of the meta-built `model` except those named in `skip` (the routed experts')."""
        load_tensors(model, self.open_tensors(), self.path, keep=lambda target: target not in skip)
        model.tie_weights()

    def load_experts(self, model: PreTrainedModel, hosted: dict[LayerId, str], experts: Sequence[int], num_experts: int) -> None:
        """Fill the experts modules named in `hosted` (shrunk to len(experts)) with those experts' rows.

        Per-expert checkpoint keys (`...experts.12.w1...`) are kept for hosted experts only and
        renumbered to their position in `experts`; fused [E, ...] tensors are read one contiguous
        run of hosted experts at a time.
        """
        position = {expert: i for i, expert in enumerate(experts)}
        rows = runs(experts)
        wanted = {f"{name}.{p}" for name in hosted.values() for p, _ in model.get_submodule(name).named_parameters()}

        def select(key: str, tensor):
            match = _PER_EXPERT_KEY.search(key)
            if match:  # one tensor per expert: keep ours, renumbered 0..n-1
                expert = int(match.group(1))
                if expert not in position:
                    return None
                return key[: match.start()] + f".experts.{position[expert]}." + key[match.end() :], tensor
            shape = tensor.get_shape()
            if not shape or shape[0] != num_experts:
                raise ModelError(f"{self.path}: fused expert tensor {key} has shape {shape}, expected [{num_experts}, ...]")
            return key, Rows(tensor, rows)

        load_tensors(model, self.open_tensors(), self.path, keep=lambda target: target in wanted, select=select)

    def load_reference(self) -> PreTrainedModel:
        """The whole model with transformers' eager experts, loaded as transformers loads it, its plain
        rotary modules' tables from C as every model built here (model/skeleton.py)."""
        model = AutoModelForCausalLM.from_pretrained(self.path, experts_implementation="eager")
        use_rotary_tables(model)
        return model.eval()

    def load_tokenizer(self) -> object | None:
        if (self.path / "tokenizer.json").exists() or (self.path / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(self.path)
        return None

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
