"""Loading a model, in whole or in part, from any model source (a directory or a GGUF file).

- `load_backbone`: every tensor except the routed experts'; those stay on the meta device and
  are never read.
- `load_experts`: only the given experts (any set) of the chosen layers; the experts modules are
  shrunk to that many experts first, so no other expert's bytes are read.
- `load_local`: everything, with the eager experts implementation: the reference.

Each takes a path or an opened `ModelSource` and works only through that protocol.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from transformers import PreTrainedModel

from moeswarm.errors import ModelError
from moeswarm.ids import ExpertId, LayerId, format_ids
from moeswarm.model.attention_threads import attention_on_one_thread
from moeswarm.model.experts import expert_parameter_names, experts_modules, layer_index
from moeswarm.model.hosted import HostedLayer
from moeswarm.model.skeleton import meta_model, shrink_experts
from moeswarm.sources.source import ModelSource, as_source
from moeswarm.progress import chunks, progress, status

# Experts are loaded in at most this many calls, one progress step each: a model directory's
# loader scans every checkpoint key per call, so one call per layer would cost layers x keys.
LOAD_STEPS = 16

PathOrSource = str | os.PathLike | ModelSource


def empty_model(path_or_source: PathOrSource) -> PreTrainedModel:
    """The model's modules with parameters on the meta device and real buffers (rotary inv_freq)."""
    return meta_model(as_source(path_or_source).config)


def load_local(path_or_source: PathOrSource) -> PreTrainedModel:
    """The whole model with transformers' eager experts (every expert): what remote execution must equal."""
    source = as_source(path_or_source)
    attention_on_one_thread()
    with status(f"loading the whole model from {source.path}"):
        return source.load_reference()


def load_backbone(path_or_source: PathOrSource, layers: range | None = None, ends: bool = True,
                  ) -> tuple[PreTrainedModel, ModelSource]:
    """The model without its routed experts: their parameters stay on meta and are never read.

    layers: only these decoder layers' trunks (None: every layer); ends: the embeddings, final
    norm and head too (a stage of a chain holds neither: stages/)."""
    source = as_source(path_or_source)
    attention_on_one_thread()
    model = meta_model(source.config)
    skip = expert_parameter_names(model) | _outside(model, layers, ends)
    with status(f"loading the backbone from {source.path}"):
        source.load_backbone(model, skip)
    left_on_meta = sorted(n for n, p in model.named_parameters() if p.is_meta and n not in skip)
    if left_on_meta:
        raise ModelError(f"{source.path}: the checkpoint lacks backbone tensors {left_on_meta[:5]}")
    return model, source


def _outside(model: PreTrainedModel, layers: range | None, ends: bool) -> set[str]:
    """Parameter names outside `layers` (decoder layer indices) and, without `ends`, outside every layer."""
    skip = set()
    for name, _ in model.named_parameters():
        layer = layer_index(name)
        if layer is None:
            if not ends:
                skip.add(name)
        elif layers is not None and layer not in layers:
            skip.add(name)
    return skip


def load_experts(path_or_source: PathOrSource, experts: Sequence[int] | None = None, layers: tuple[int, int] | None = None,
                 ) -> tuple[dict[LayerId, HostedLayer], ModelSource, int]:
    """The given experts of every MoE layer in `layers` (inclusive range), and nothing else.

    experts: ascending distinct global ids; None: what the source holds (every expert of a whole
    model, a slice file's experts). layers: None: every MoE layer the source holds.
    Returns ({layer: HostedLayer}, the source, the model's number of routed experts per layer).
    """
    source = as_source(path_or_source)
    model = meta_model(source.config)
    modules = experts_modules(model)
    if not modules:
        raise ModelError(f"{source.path}: model type {source.config.model_type!r} has no routed experts")
    num_experts = next(iter(modules.values()))[1].num_experts
    chosen = _chosen_layers(source, sorted(modules), layers)
    wanted = _chosen_experts(source, experts, num_experts)
    for layer in chosen:
        shrink_experts(modules[layer][1], len(wanted))
    with progress(desc=f"loading {len(wanted)} experts", total=len(chosen), unit="layer") as bar:
        for part in chunks(chosen, LOAD_STEPS):
            source.load_experts(model, {layer: modules[layer][0] for layer in part}, wanted, num_experts)
            bar.update(len(part))
    # A source may have put another module in an experts module's place (GGUF experts kept quantized).
    loaded = {layer: model.get_submodule(modules[layer][0]) for layer in chosen}
    missing = sorted(f"{modules[layer][0]}.{p}" for layer in chosen for p, value in loaded[layer].named_parameters()
                     if value.is_meta)
    if missing:
        raise ModelError(f"{source.path}: the checkpoint lacks expert tensors {missing[:5]}")
    hosted = {layer: HostedLayer(layer, wanted, loaded[layer]) for layer in chosen}
    return hosted, source, num_experts


def _chosen_layers(source: ModelSource, moe_layers: list[LayerId], layers: tuple[int, int] | None) -> list[LayerId]:
    held = source.held_layers
    if layers is None:
        chosen = [layer for layer in moe_layers if held is None or layer in held]
    else:
        chosen = [layer for layer in moe_layers if layers[0] <= layer <= layers[1]]
        lacking = [layer for layer in chosen if held is not None and layer not in held]
        if lacking:
            raise ModelError(f"{source.path}: this slice file holds the experts of MoE layers {format_ids(sorted(held))}, "
                             f"not of the requested layers {format_ids(lacking)}")
    if not chosen:
        asked = f"in range {layers[0]}-{layers[1]}" if layers is not None else "held by the source"
        raise ModelError(f"{source.path}: no MoE layer {asked}: the model's MoE layers are {format_ids(moe_layers)}")
    return chosen


def _chosen_experts(source: ModelSource, experts: Sequence[int] | None, num_experts: int) -> tuple[ExpertId, ...]:
    if experts is None:
        held = source.held_experts
        return tuple(ExpertId(e) for e in (held if held is not None else range(num_experts)))
    wanted = tuple(ExpertId(int(e)) for e in experts)
    if not wanted or list(wanted) != sorted(set(wanted)):
        raise ModelError(f"experts must be a non-empty list of distinct ascending ids, got {list(wanted)}")
    if wanted[0] < 0 or wanted[-1] >= num_experts:
        raise ModelError(f"experts {format_ids(wanted)} out of range: the model has experts 0-{num_experts - 1}")
    return wanted


__all__ = ["HostedLayer", "ModelSource", "empty_model", "load_backbone", "load_experts", "load_local"]
