"""Models straight from a GGUF file: the backbone, expert slices, and the whole model.

The same three loaders as moeswarm.model.loading, for a `.gguf` path (that module dispatches
here). The model skeleton is transformers' own (built on meta from the config mapped out of the
GGUF metadata); tensors are dequantized to float32 as they are assigned:

- backbone: every non-expert tensor; routed-expert tensors are never read (they stay on meta).
- expert slice: for each hosted layer, the byte range [e*nb2, (e+1)*nb2) of each stacked expert
  tensor for the hosted experts only, dequantized into the family's fused layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from moeswarm.errors import ModelError
from moeswarm.ids import ExpertId, LayerId
from moeswarm.weights.gguf_config import config_from_gguf
from moeswarm.weights.gguf_dequant import check_supported, dequantize
from moeswarm.weights.gguf_file import GGUFFile
from moeswarm.weights.gguf_names import QUIRKS, NameMapper, expert_tensor_names, fuse_experts


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF model file (whole, or a slice file): the sibling of model.checkpoint.Checkpoint."""

    path: Path

    @classmethod
    def open(cls, path: str | Path) -> "GGUFCheckpoint":
        checkpoint = cls(Path(path))
        checkpoint.file  # validate now: a bad file fails here, with its name  # noqa: B018
        return checkpoint

    @cached_property
    def file(self) -> GGUFFile:
        return GGUFFile.open(self.path)

    @cached_property
    def config(self) -> PretrainedConfig:
        return config_from_gguf(self.file)

    @property
    def fingerprint(self) -> str:
        return self.file.fingerprint


def _empty_model(checkpoint: GGUFCheckpoint) -> PreTrainedModel:
    from moeswarm.model.loading import empty_model

    return empty_model(checkpoint)


def load_backbone(path) -> tuple[PreTrainedModel, GGUFCheckpoint]:
    """The model without routed experts: non-expert tensors dequantized to float32."""
    from moeswarm.model.experts import expert_parameter_names

    checkpoint = GGUFCheckpoint.open(path)
    model = _empty_model(checkpoint)
    skip = expert_parameter_names(model)
    _load_backbone_tensors(model, checkpoint, skip)
    return model, checkpoint


def _load_backbone_tensors(model: PreTrainedModel, checkpoint: GGUFCheckpoint, skip: set[str]) -> None:
    f = checkpoint.file
    mapper = NameMapper(f, checkpoint.config, lambda name: dequantize(f.path, f.tensor(name)))
    state, missing = {}, []
    for name, tensor in model.state_dict().items():
        if name in skip or (name == "lm_head.weight" and checkpoint.config.tie_word_embeddings):
            continue
        source = mapper.source(name)
        if source is None:
            if tensor.is_meta:
                missing.append(name)
            continue
        value = source()
        if tuple(value.shape) != tuple(tensor.shape) and _squeezed(value.shape) == _squeezed(tensor.shape):
            value = value.reshape(tensor.shape)  # llama.cpp drops trailing ne of 1 ([1, H] -> [H])
        if tuple(value.shape) != tuple(tensor.shape):
            raise ModelError(f"{f.path}: tensor for {name} has shape {tuple(value.shape)}, the model expects {tuple(tensor.shape)}")
        state[name] = value.to(tensor.dtype)
    if missing:
        hint = " (a slice file made without --with-backbone holds experts only)" if f.is_slice else ""
        raise ModelError(f"{f.path}: the GGUF file lacks backbone tensors for {missing[:5]}{hint}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()


def load_expert_slice(path, layers: tuple[int, int] | None, experts: tuple[int, int]):
    """Experts [low, high] of every MoE layer in `layers` (all when None): (slices, checkpoint, num_experts)."""
    from moeswarm.model.loading import ExpertSlice, hosted_modules

    checkpoint = GGUFCheckpoint.open(path)
    f = checkpoint.file
    model = _empty_model(checkpoint)
    held_layers = set(f.sliced_layers) if f.sliced_layers is not None else None
    chosen, num_experts = hosted_modules(model, str(f.path), layers, experts, held_layers)
    low, high = experts
    _check_slice_holds(f, range(low, high + 1))
    quirks = QUIRKS[f.arch]
    rows = slice(low - f.expert_first, high + 1 - f.expert_first)
    slices = {}
    for layer, (_, module) in chosen.items():
        parts = {}
        for role, name in expert_tensor_names(layer).items():
            if name in f.tensors:
                check_supported(f.path, f.tensors[name])
                parts[role] = dequantize(f.path, f.tensors[name], rows)
        if not {"gate", "up", "down"} <= parts.keys():
            raise ModelError(f"{f.path}: layer {layer} lacks stacked expert tensors blk.{layer}.ffn_{{gate,up,down}}_exps")
        for param_name, value in fuse_experts(quirks, parts).items():
            expected = tuple(getattr(module, param_name).shape)
            if tuple(value.shape) != expected:
                raise ModelError(f"{f.path}: layer {layer} {param_name} has shape {tuple(value.shape)}, the model expects {expected}")
            setattr(module, param_name, torch.nn.Parameter(value, requires_grad=False))
        slices[LayerId(layer)] = ExpertSlice(LayerId(layer), ExpertId(low), ExpertId(high), module)
    return slices, checkpoint, num_experts


def _check_slice_holds(f: GGUFFile, wanted: range) -> None:
    held = f.expert_ids
    if held is None:
        return
    lacking = [e for e in wanted if e not in held]
    if lacking:
        raise ModelError(
            f"{f.path}: this slice file holds experts {_span(held)}, not the requested experts "
            f"{_span(lacking)} (requested {wanted.start}-{wanted.stop - 1})"
        )


def load_local(path) -> PreTrainedModel:
    """The whole model (every expert) with transformers' eager experts: the reference."""
    model, checkpoint = load_backbone(path)
    from moeswarm.model.experts import experts_modules

    num = next(iter(experts_modules(model).values()))[1].num_experts
    slices, _, _ = load_expert_slice(path, None, (0, num - 1))
    for layer, (name, _) in experts_modules(model).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, slices[layer].module)
    return model.eval()


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _span(values) -> str:
    values = sorted(values)
    if values and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))
