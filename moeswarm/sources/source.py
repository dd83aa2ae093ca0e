"""Where a model's weights come from: a Hugging Face directory or a GGUF file, decided once.

`open_source(path)` is the one place that tells the two apart (by the `.gguf` suffix); from then
on every loader works through the `ModelSource` protocol, which both `Checkpoint` (a directory,
moeswarm.sources.hf_directory) and `GGUFCheckpoint` (moeswarm.sources.gguf_source) implement.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from transformers import PretrainedConfig, PreTrainedModel

from moeswarm.ids import LayerId
from moeswarm.sources.hf_directory import Checkpoint
from moeswarm.sources.gguf_source import GGUFCheckpoint

GGUF_SUFFIX = ".gguf"


@runtime_checkable
class ModelSource(Protocol):
    """A model's config, identity and weights, loadable in parts."""

    path: Path
    kind: str  # "hf" (a model directory) or "gguf" (a GGUF file)

    @property
    def config(self) -> PretrainedConfig: ...

    @property
    def fingerprint(self) -> str:
        """The model's identity: equal for every source of the same weights (a slice file included)."""

    @property
    def held_layers(self) -> frozenset[int] | None:
        """The MoE layers whose experts this source stores (a GGUF slice file); None: every layer."""

    @property
    def held_experts(self) -> tuple[int, ...] | None:
        """The experts this source stores, ascending (a GGUF slice file); None: every expert."""

    def load_backbone(self, model: PreTrainedModel, skip: set[str]) -> None:
        """Assign every parameter of the meta-built `model` except those named in `skip`."""

    def load_experts(self, model: PreTrainedModel, hosted: dict[LayerId, str], experts: Sequence[int],
                     num_experts: int) -> None:
        """Fill the experts modules `hosted` ({layer: qualified module name}) with experts `experts`.

        Each module has been shrunk to len(experts) experts (or is whole when every expert is
        asked for); its expert i receives the model's expert experts[i]. num_experts: the model's
        routed experts per layer. Only the hosted experts' bytes are read.
        """

    def load_reference(self) -> PreTrainedModel:
        """The whole model with transformers' eager experts: what remote execution must equal."""

    def load_tokenizer(self) -> object | None:
        """The source's tokenizer (a transformers tokenizer), or None when it has none."""


def is_gguf_path(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


def open_source(path: str | os.PathLike, backbone_dtype: str = "file", experts_dtype: str = "file") -> ModelSource:
    """The model at `path`: a GGUF file when it ends in .gguf, else a model directory.

    backbone_dtype: a GGUF file's non-expert matrices kept in the file's encoding ("file") or
    loaded as float32 ("f32"); the backbone and any reference loaded from this source follow it.
    experts_dtype: likewise for its routed experts (computed from the file's blocks, or dequantized
    to float32 into the family's own module: a reference for the kernels' tests).
    Raises ModelError naming the path when it is missing or is not a usable model.
    """
    if is_gguf_path(path):
        return GGUFCheckpoint.open(path, backbone_dtype, experts_dtype)
    return Checkpoint.open(path)


def as_source(path_or_source: str | os.PathLike | ModelSource) -> ModelSource:
    """A source as given, or opened from a path."""
    if isinstance(path_or_source, (str, os.PathLike)):
        return open_source(path_or_source)
    return path_or_source
