"""A GGUF file (a whole model, or a slice file) as a model source.

It implements moeswarm.sources.source.ModelSource. The model skeleton is transformers' own, built
on meta from the config mapped out of the GGUF metadata; tensors are dequantized to float32 as
they are assigned, except routed experts, which stay in the file's blocks (memory-mapped) and are
computed from them (kernels/quant_experts.py) where the C kernels do the family's maths:

- backbone: every non-expert tensor; routed-expert tensors are never read (they stay on meta).
- experts: for each hosted layer, the byte ranges [e*nb2, (e+1)*nb2) of each stacked expert
  tensor for the hosted experts only (one read per contiguous run), fused into the family's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch
from transformers import PretrainedConfig, PreTrainedModel

from moeswarm.errors import ModelError
from moeswarm.ids import LayerId, format_ids, runs
from moeswarm.model.experts import expert_parameter_names, experts_modules
from moeswarm.model.skeleton import meta_model
from moeswarm.kernels.gguf_backbone import encode_backbone, tie_encoded
from moeswarm.kernels.gguf_latent import encode_latent
from moeswarm.kernels.row_invariant import make_rows_invariant
from moeswarm.kernels.row_ops import use_row_ops
from moeswarm.kernels.quant_linear import check_dtype
from moeswarm.gguf.gguf_config import config_from_gguf
from moeswarm.gguf.gguf_dequant import dequantize
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_names import QUIRKS, NameMapper, expert_roles, expert_tensor_names, fuse_experts
from moeswarm.kernels.gguf_quant_load import quant_experts, use_quantized
from moeswarm.gguf.gguf_tokenizer import gguf_tokenizer


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF model file (whole, or a slice file): the sibling of model.checkpoint.Checkpoint."""

    path: Path
    backbone_dtype: str = "file"  # non-expert matrices in the file's encoding, or "f32" (kernels/quant_linear.py)
    experts_dtype: str = "file"  # routed experts from the file's blocks, or "f32" (kernels/gguf_quant_load.py)
    kind: ClassVar[str] = "gguf"

    @classmethod
    def open(cls, path: str | Path, backbone_dtype: str = "file", experts_dtype: str = "file") -> "GGUFCheckpoint":
        checkpoint = cls(Path(path), check_dtype(backbone_dtype, "backbone"), check_dtype(experts_dtype, "experts"))
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

    @property
    def held_layers(self) -> frozenset[int] | None:
        """The MoE layers whose experts a slice file stores; None for a whole model file."""
        layers = self.file.sliced_layers
        return frozenset(layers) if layers is not None else None

    @property
    def held_experts(self) -> tuple[int, ...] | None:
        """The experts a slice file stores (ascending); None for a whole model file."""
        ids = self.file.expert_ids
        return tuple(ids) if ids is not None else None

    def load_backbone(self, model: PreTrainedModel, skip: set[str]) -> None:
        """Every non-expert tensor (float32, or kept encoded: gguf_backbone.py); those in `skip` are never read."""
        f = self.file
        mapper = NameMapper(f, self.config, lambda name: dequantize(f.path, f.tensor(name)))
        encoded = encode_backbone(model, mapper, skip, self.backbone_dtype)  # matrices kept in the file's encoding
        encode_latent(model, mapper, skip, self.backbone_dtype)  # latent attention's absorbed products: the file's blocks
        state, missing = {}, []
        for name, tensor in model.state_dict().items():
            if name in skip or name in encoded or (name == "lm_head.weight" and self.config.tie_word_embeddings):
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
        if not (self.config.tie_word_embeddings and tie_encoded(model)):
            model.tie_weights()
        if self.backbone_dtype == "file":
            make_rows_invariant(model)  # the F32 matrices left (routers): a row's bits whatever the batch
            use_row_ops(model)  # norms and rotary in one C call each

    def load_experts(self, model: PreTrainedModel, hosted: dict[LayerId, str], experts: Sequence[int], num_experts: int) -> None:
        """Fill the experts modules named in `hosted` (shrunk to len(experts)) with those experts.

        Where the experts stay quantized, the module at each name is replaced by a QuantExperts
        (callers re-read it with model.get_submodule).
        """
        f = self.file
        stored = self.held_experts if self.held_experts is not None else tuple(range(num_experts))
        where = {expert: i for i, expert in enumerate(stored)}  # global id -> index along ne[2]
        lacking = [e for e in experts if e not in where]
        if lacking:
            raise ModelError(f"{f.path}: this slice file holds experts {format_ids(stored)}, not the requested "
                             f"experts {format_ids(lacking)} (requested {format_ids(experts)})")
        stored_runs = runs([where[e] for e in experts])  # contiguous ranges of stored experts to read
        for layer, name in hosted.items():
            module = model.get_submodule(name)
            if use_quantized(f, layer, module, QUIRKS[f.arch], self.experts_dtype):
                model.set_submodule(name, quant_experts(f, layer, module, QUIRKS[f.arch], stored_runs))
                continue
            parts = {}
            for role, tensor_name in expert_tensor_names(layer).items():
                if tensor_name in f.tensors:
                    tensor = f.tensors[tensor_name]
                    pieces = [dequantize(f.path, tensor, slice(run.start, run.stop)) for run in stored_runs]
                    parts[role] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [n, ...]
            roles = expert_roles(QUIRKS[f.arch])
            if not set(roles) <= parts.keys():
                raise ModelError(f"{f.path}: layer {layer} lacks stacked expert tensors blk.{layer}.ffn_{{{','.join(roles)}}}_exps")
            for param_name, value in fuse_experts(QUIRKS[f.arch], parts).items():
                expected = tuple(getattr(module, param_name).shape)
                if tuple(value.shape) != expected:
                    raise ModelError(f"{f.path}: layer {layer} {param_name} has shape {tuple(value.shape)}, the model expects {expected}")
                setattr(module, param_name, torch.nn.Parameter(value, requires_grad=False))

    def load_reference(self) -> PreTrainedModel:
        """The whole model (every expert) with transformers' eager experts."""
        model = meta_model(self.config)
        self.load_backbone(model, expert_parameter_names(model))
        modules = experts_modules(model)
        num_experts = next(iter(modules.values()))[1].num_experts
        self.load_experts(model, {layer: name for layer, (name, _) in modules.items()}, range(num_experts), num_experts)
        return model.eval()

    def load_tokenizer(self) -> object | None:
        return gguf_tokenizer(self.file) if "tokenizer.ggml.tokens" in self.file.metadata else None


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)
