"""Loading models from a Hugging Face directory, in whole or in part.

All three loaders use transformers' own key renaming and conversion (per-expert checkpoints are
stacked into the fused `gate_up_proj`/`down_proj` parameters, mixtral's `w1/w3/w2` renamed...),
so every family loads the way transformers loads it. What differs is which checkpoint tensors
are handed to that machinery:

- `load_backbone`: every tensor except the routed experts'; those stay on the meta device and
  are never read.
- `load_expert_slice`: only the experts [low, high] of the chosen layers; the experts modules are
  shrunk to that many experts first, and per-expert keys renumbered, so no other byte is read.
- `load_local`: everything, with the eager experts implementation: the reference.

A `.gguf` path goes to moeswarm.weights.gguf_model, which loads the same things from GGUF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    convert_and_load_state_dict_in_model,
    rename_source_key,
)
from transformers.modeling_utils import LoadStateDictConfig
from transformers.utils import logging as hf_logging

from moeswarm.errors import ModelError
from moeswarm.ids import ExpertId, LayerId
from moeswarm.model.checkpoint import Checkpoint
from moeswarm.model.experts import expert_parameter_names, experts_modules
from moeswarm.weights.gguf_file import is_gguf_path

_PER_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def empty_model(checkpoint: Checkpoint) -> PreTrainedModel:
    """The model's modules with parameters on the meta device and real buffers (rotary inv_freq)."""
    _quiet()
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(checkpoint.config, experts_implementation="eager")
    model.eval()
    return model


def load_local(path) -> PreTrainedModel:
    """The whole model with transformers' eager experts: what remote execution must equal."""
    if is_gguf_path(path):
        from moeswarm.weights import gguf_model

        return gguf_model.load_local(path)
    checkpoint = Checkpoint.open(path)
    _quiet()
    model = AutoModelForCausalLM.from_pretrained(checkpoint.path, experts_implementation="eager")
    return model.eval()


def load_backbone(path) -> tuple[PreTrainedModel, Checkpoint]:
    """The model without its routed experts: their parameters stay on meta and are never read."""
    if is_gguf_path(path):
        from moeswarm.weights import gguf_model

        return gguf_model.load_backbone(path)
    checkpoint = Checkpoint.open(path)
    model = empty_model(checkpoint)
    skip = expert_parameter_names(model)
    _load(model, checkpoint, keep=lambda target: target not in skip)
    model.tie_weights()
    left_on_meta = sorted(n for n, p in model.named_parameters() if p.is_meta and n not in skip)
    if left_on_meta:
        raise ModelError(f"{checkpoint.path}: checkpoint lacks backbone tensors {left_on_meta[:5]}")
    return model, checkpoint


@dataclass(frozen=True)
class ExpertSlice:
    """One layer's hosted experts: an experts module holding experts [low, high] as 0..n-1."""

    layer: LayerId
    low: ExpertId
    high: ExpertId
    module: torch.nn.Module

    @property
    def experts(self) -> range:
        return range(self.low, self.high + 1)


def load_expert_slice(path, layers: tuple[int, int] | None, experts: tuple[int, int]) -> tuple[dict[LayerId, ExpertSlice], Checkpoint, int]:
    """Experts [low, high] of every MoE layer in `layers` (all when None), and nothing else.

    Returns (slices by layer, checkpoint, the model's number of routed experts per layer).
    """
    if is_gguf_path(path):
        from moeswarm.weights import gguf_model

        return gguf_model.load_expert_slice(path, layers, experts)
    checkpoint = Checkpoint.open(path)
    model = empty_model(checkpoint)
    chosen, num_experts = hosted_modules(model, str(checkpoint.path), layers, experts)
    low, high = experts
    wanted = {f"{name}.{p}" for name, module in chosen.values() for p, _ in module.named_parameters()}
    num_hosted = high - low + 1

    def select(key: str, tensor):
        match = _PER_EXPERT_KEY.search(key)
        if match:  # one tensor per expert: keep ours, renumbered from 0
            expert = int(match.group(1))
            if not low <= expert <= high:
                return None
            return key[: match.start()] + f".experts.{expert - low}." + key[match.end() :], tensor
        shape = tensor.get_shape()
        if not shape or shape[0] != num_experts:
            raise ModelError(f"{checkpoint.path}: fused expert tensor {key} has shape {shape}, expected [{num_experts}, ...]")
        return key, _RowSlice(tensor, low, low + num_hosted)

    _load(model, checkpoint, keep=lambda target: target in wanted, select=select)
    missing = sorted(name for name in wanted if _get(model, name).is_meta)
    if missing:
        raise ModelError(f"{checkpoint.path}: checkpoint lacks expert tensors {missing[:5]}")
    slices = {layer: ExpertSlice(layer, ExpertId(low), ExpertId(high), module) for layer, (_, module) in chosen.items()}
    return slices, checkpoint, num_experts


def hosted_modules(model: PreTrainedModel, source: str, layers: tuple[int, int] | None, experts: tuple[int, int],
                   held_layers: set[int] | None = None) -> tuple[dict[LayerId, tuple[str, torch.nn.Module]], int]:
    """The experts modules a worker hosts, shrunk to experts [low, high]; and the model's expert count.

    held_layers: the MoE layers the source holds (a slice file), None for all. Without `layers`
    the worker serves what the source holds; layers asked for and not held are refused.
    """
    modules = experts_modules(model)
    if not modules:
        raise ModelError(f"{source}: model type {model.config.model_type!r} has no routed experts")
    num_experts = next(iter(modules.values()))[1].num_experts
    low, high = experts
    if high >= num_experts:
        raise ModelError(f"experts {low}-{high} out of range: the model has experts 0-{num_experts - 1}")
    chosen = {layer: entry for layer, entry in modules.items() if layers is None or layers[0] <= layer <= layers[1]}
    if held_layers is not None:
        lacking = sorted(layer for layer in chosen if layer not in held_layers)
        if layers is None:
            chosen = {layer: entry for layer, entry in chosen.items() if layer in held_layers}
        elif lacking:
            raise ModelError(f"{source}: this slice file holds MoE layers {sorted(held_layers)}, not the requested layers {lacking}")
    if not chosen:
        raise ModelError(f"no MoE layer in range {layers}: the model's MoE layers are {sorted(modules)}")
    for _, module in chosen.values():
        _shrink_to(module, high - low + 1)
    return chosen, num_experts


def _load(model: PreTrainedModel, checkpoint: Checkpoint, keep, select=None) -> None:
    """Hand the checkpoint tensors whose renamed target passes `keep` to transformers' loader."""
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    chosen = {}
    for key, tensor in checkpoint.open_tensors().items():
        target, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if not keep(target):
            continue
        picked = (key, tensor) if select is None else select(key, tensor)
        if picked is not None:
            chosen[picked[0]] = picked[1]
    info, _ = convert_and_load_state_dict_in_model(model, chosen, LoadStateDictConfig(weight_mapping=mapping))
    if info.mismatched_keys or info.conversion_errors:
        raise ModelError(
            f"{checkpoint.path}: tensors do not fit the model: "
            f"{sorted(info.mismatched_keys)[:5] or list(info.conversion_errors.items())[:3]}"
        )


def _quiet() -> None:
    """No per-tensor progress bars or warnings from transformers: moeswarm prints its own lines."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _shrink_to(module: torch.nn.Module, num_experts: int) -> None:
    """Resize an experts module's (meta) parameters to `num_experts` along the expert axis."""
    for name, param in list(module.named_parameters(recurse=False)):
        shape = (num_experts, *param.shape[1:])
        setattr(module, name, torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=False))
    module.num_experts = num_experts


def _get(model: torch.nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name), attr)


class _RowSlice:
    """A lazy safetensors slice restricted to rows [start, stop) of its first axis."""

    def __init__(self, tensor, start: int, stop: int):
        self._tensor, self._start, self._stop = tensor, start, stop

    def __getitem__(self, item) -> torch.Tensor:
        return self._tensor[self._start : self._stop]

    def get_shape(self) -> list[int]:
        return [self._stop - self._start, *self._tensor.get_shape()[1:]]

    def get_dtype(self):
        return self._tensor.get_dtype()
