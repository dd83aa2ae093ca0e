"""GGUF tensor names <-> transformers parameter names: the names table, one entry an architecture.

gguf-py's `TensorNameMap` knows the Hugging Face checkpoint names of every GGUF tensor (it is what
llama.cpp's converter uses), so the plain mapping is a lookup. What the converter changes on the
way is undone here, from the table entry (read from llama.cpp's conversion/*.py):

- `permute_qk`: q_proj and k_proj rows were permuted for llama.cpp's RoPE ("undo_permute": Mixtral,
  Granite).
- `renames`: a transformers parameter whose name differs from the checkpoint name TensorNameMap
  knows (transformers 5 renames some on load: GraniteMoE's `router.layer` is `router`).
- `merged`: a transformers parameter the converter split in two (GraniteMoE-Shared's
  `shared_mlp.input_linear` = ffn_gate_shexp rows then ffn_up_shexp rows).
- `transforms`: the inverse of the converter's arithmetic on a tensor (gguf_transforms.py: Qwen3-Next's
  +1 norms, Mamba's A = -exp(A_log), the linear-attention head reorders).
- `keep_float`: modules whose weight the family reads directly (Jamba's `dt_proj.weight @ x`), never
  kept in the file's blocks (gguf_backbone.py).
- `experts`: the routed experts' layout (below).
- every architecture: a router's e_score_correction_bias is `exp_probs_b.bias`; DeepSeek's MLA
  kv_b_proj was split into attn_k_b (transposed per head) and attn_v_b; gpt-oss's attention sinks
  carry a `.weight` suffix.

Expert layouts: "gate_up": transformers' fused `gate_up_proj` [E, 2I, H] is ffn_gate_exps then
ffn_up_exps; "gpt_oss": stored transposed, gate and up de-interleaved (transformers keeps them
interleaved: gate = [..., ::2], up = [..., 1::2]); "up": no gate (Nemotron-H's squared-ReLU experts);
"fused": one ffn_gate_up_exps tensor, already transformers' gate_up_proj (Granite SWA).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch

from moeswarm.errors import ModelError
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_support import require_supported
from moeswarm.gguf.gguf_transforms import (a_log, qkv_value_rows, qkvz_per_key_head, value_columns, value_heads,
                                              value_rows, zero_centered_norm)

_LAYER = re.compile(r"\.layers\.(\d+)\.")
Transform = Callable[[torch.Tensor, object], torch.Tensor]  # (tensor as stored, config) -> the parameter


@dataclass(frozen=True)
class ArchQuirks:
    permute_qk: bool = False  # llama.cpp permuted q/k rows for its rotary layout
    experts: str = "gate_up"  # "gate_up": [E, 2I, H] = cat(gate, up); "gpt_oss": [E, H, 2I] interleaved; "up"; "fused"
    renames: tuple[tuple[str, str], ...] = ()  # (regex on the transformers name, re.sub replacement: a name TensorNameMap knows)
    merged: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (transformers name suffix, GGUF suffixes stacked on rows)
    transforms: tuple[tuple[str, Transform], ...] = ()  # (regex on the transformers name, inverse of the converter's maths)
    keep_float: tuple[str, ...] = ()  # regexes on module names whose weight the family's code reads directly
    names_as: str | None = None  # the architecture whose TensorNameMap to use (one the installed gguf-py lacks)
    tensors: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (transformers name suffix, GGUF names in a layer, first found)


# Every architecture: the router's score-correction bias, wherever the family keeps it (some
# converters write it without the .bias suffix).
_BIAS = ("exp_probs_b.bias", "exp_probs_b")
_COMMON_TENSORS = (("mlp.gate.e_score_correction_bias", _BIAS), ("mlp.e_score_correction_bias", _BIAS),
                   ("feed_forward.expert_bias", _BIAS), ("mlp.expert_bias", _BIAS),
                   ("mlp.gate.moe_statics.e_score_correction_bias", _BIAS), ("mlp.router.e_score_correction_bias", _BIAS))
_QWEN3NEXT = ArchQuirks(
    renames=((r"linear_attn\.dt_bias$", "linear_attn.dt_proj.bias"),),
    merged=(("linear_attn.in_proj_qkvz.weight", ("attn_qkv.weight", "attn_gate.weight")),),
    transforms=((r"linear_attn\.in_proj_qkvz\.weight$", qkvz_per_key_head), (r"linear_attn\.A_log$", a_log),
                (r"(?<!linear_attn\.)norm\.weight$", zero_centered_norm)))
_QWEN35MOE = ArchQuirks(
    renames=_QWEN3NEXT.renames,
    transforms=((r"linear_attn\.(in_proj_qkv|conv1d)\.weight$", qkv_value_rows), (r"linear_attn\.in_proj_z\.weight$", value_rows),
                (r"linear_attn\.(in_proj_[ab]\.weight|A_log|dt_bias)$", value_heads),
                (r"linear_attn\.out_proj\.weight$", value_columns), *_QWEN3NEXT.transforms[1:]))
_GRANITE = ArchQuirks(permute_qk=True, renames=((r"block_sparse_moe\.router\.weight$", "block_sparse_moe.router.layer.weight"),),
                      merged=(("shared_mlp.input_linear.weight", ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")),))

_GRANITE_HYBRID = ArchQuirks(permute_qk=True, renames=(*_GRANITE.renames, (r"mamba\.dt_bias$", "mamba.dt_proj.bias")),
                             merged=_GRANITE.merged, transforms=((r"mamba\.A_log$", a_log),))

# Nemotron-H: transformers 5 names the layers model.layers.N.mixer, the checkpoints backbone.layers.N.mixer.
_NEMOTRON_H = ArchQuirks(experts="up", renames=((r"^model\.layers\.(\d+)\.mixer\.", r"backbone.layers.\1.mixer."),
                                                (r"mixer\.dt_bias$", "mixer.dt_proj.bias")),
                         transforms=((r"mixer\.A_log$", a_log),))

QUIRKS: dict[str, ArchQuirks] = {
    "qwen2moe": ArchQuirks(),
    "qwen3moe": ArchQuirks(),
    "olmoe": ArchQuirks(),
    "llama": ArchQuirks(permute_qk=True),
    "deepseek2": ArchQuirks(),
    "glm4moe": ArchQuirks(),
    "gpt-oss": ArchQuirks(experts="gpt_oss"),
    "granitemoe": _GRANITE,
    "dots1": ArchQuirks(),
    "ernie4_5-moe": ArchQuirks(),
    "qwen3next": _QWEN3NEXT,
    "qwen35moe": _QWEN35MOE,
    "minimax-m2": ArchQuirks(),
    "lfm2moe": ArchQuirks(),
    "granitehybrid": _GRANITE_HYBRID,
    "nemotron_h_moe": _NEMOTRON_H,
    "hunyuan-moe": ArchQuirks(),
    "afmoe": ArchQuirks(),
    "exaone-moe": ArchQuirks(),
    # gguf-py 0.19 does not know these architectures: another's name map, plus the one name it lacks.
    "mellum": ArchQuirks(names_as="qwen3moe", tensors=(("post_attention_layernorm.weight", ("ffn_norm.weight",)),)),
    "hy_v3": ArchQuirks(names_as="glm4moe", tensors=(("post_attention_layernorm.weight", ("ffn_norm.weight",)),)),
    "laguna": ArchQuirks(names_as="afmoe", tensors=(("post_attention_layernorm.weight", ("ffn_norm.weight",)),)),
    "cohere2moe": ArchQuirks(names_as="qwen2moe"),
    # Its shared MLP stays fused (gate and up halves of ffn_up_shexp), as transformers keeps it.
    "granite_swa": ArchQuirks(permute_qk=True, names_as="granitemoe", experts="fused", renames=_GRANITE.renames,
                              tensors=(("shared_mlp.input_linear.weight", ("ffn_up_shexp.weight",)),
                                       ("shared_mlp.output_linear.weight", ("ffn_down_shexp.weight",)),
                                       ("self_attn.sinks", ("attn_sinks.weight",)))),
    "jamba": ArchQuirks(transforms=((r"mamba\.A_log$", a_log),), keep_float=(r"mamba\.dt_proj$",)),
}

Loader = Callable[[], torch.Tensor]  # reads and dequantizes on call


class NameMapper:
    """Where each non-expert transformers parameter comes from in a GGUF file."""

    def __init__(self, f: GGUFFile, config, read: Callable[[str], torch.Tensor]):
        arch_ids = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
        require_supported(f)
        self.file, self.config, self.read = f, config, read
        self.quirks = QUIRKS[f.arch]
        names_as = self.quirks.names_as or f.arch
        if names_as not in arch_ids:
            raise ModelError(f"{f.path}: GGUF architecture {names_as!r} is unknown to the installed gguf package")
        self.names = gguf.get_tensor_name_map(arch_ids[names_as], config.num_hidden_layers + 8)

    def source(self, hf_name: str) -> Loader | None:
        """A loader for `hf_name`'s tensor, or None when the file has no such tensor."""
        loader = self._stored(hf_name)
        for pattern, transform in self.quirks.transforms:  # each matching one, in the table's order
            if loader is not None and re.search(pattern, hf_name):
                loader = lambda loader=loader, transform=transform: transform(loader(), self.config)  # noqa: E731
        return loader

    def _stored(self, hf_name: str) -> Loader | None:
        """A loader for the tensor as the file stores it (merged, un-permuted), before any transform."""
        layer = _LAYER.search(hf_name)
        if layer:
            for suffix, tensors in (*_COMMON_TENSORS, *self.quirks.tensors):
                if hf_name.endswith(suffix):
                    found = [name for name in (f"blk.{layer.group(1)}.{t}" for t in tensors) if name in self.file.tensors]
                    return self._plain(found[0]) if found else None
            for suffix, parts in self.quirks.merged:
                names = [f"blk.{layer.group(1)}.{part}" for part in parts]
                if hf_name.endswith(suffix) and all(name in self.file.tensors for name in names):
                    return lambda names=names: torch.cat([self.read(name) for name in names])
        if hf_name.endswith("self_attn.kv_b_proj.weight") and layer and f"blk.{layer.group(1)}.attn_k_b.weight" in self.file.tensors:
            return lambda: self._merge_kv_b(layer.group(1))
        name = self._lookup(hf_name)
        if name is None:
            return None
        for candidate in (name, f"{name}.weight"):  # gpt-oss sinks carry a .weight suffix
            if candidate in self.file.tensors:
                if self.quirks.permute_qk and re.search(r"\.attn_[qk]\.(weight|bias)$", candidate):
                    return lambda c=candidate: self._unpermute(c)
                return self._plain(candidate)
        return None

    def plain_tensor(self, hf_name: str) -> str | None:
        """The GGUF tensor `hf_name` is stored in as it is (no permutation, no merge), or None; None
        too where the family's code reads the module's weight itself (it must stay a float tensor)."""
        layer = _LAYER.search(hf_name)
        if any(re.search(pattern, hf_name.rpartition(".")[0]) for pattern in self.quirks.keep_float):
            return None
        if hf_name.endswith("self_attn.kv_b_proj.weight") and layer:
            return None
        if any(hf_name.endswith(suffix) for suffix, _ in self.quirks.merged):
            return None
        if any(re.search(pattern, hf_name) for pattern, _ in self.quirks.transforms):
            return None
        name = self._lookup(hf_name)
        if name is None or name not in self.file.tensors:
            return None
        if self.quirks.permute_qk and re.search(r"\.attn_[qk]\.(weight|bias)$", name):
            return None
        return name

    def _lookup(self, hf_name: str) -> str | None:
        """The GGUF name TensorNameMap gives `hf_name` (after the table's renames), or None."""
        for pattern, replacement in self.quirks.renames:
            hf_name = re.sub(pattern, replacement, hf_name)
        return self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    def _plain(self, name: str) -> Loader | None:
        return (lambda: self.read(name)) if name in self.file.tensors else None

    def _unpermute(self, name: str) -> torch.Tensor:
        """Invert llama.cpp's LlamaModel.permute: (h, 2, d/2, ...) -> (h, d/2, 2, ...) rows."""
        tensor = self.read(name)
        heads = self.config.num_attention_heads if ".attn_q." in name else self.config.num_key_value_heads
        shape = tensor.shape
        return tensor.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)

    def _merge_kv_b(self, layer: str) -> torch.Tensor:
        """kv_b_proj [H*(nope+v), L] from attn_k_b [H, L, nope] and attn_v_b [H, v, L]."""
        k_b = self.read(f"blk.{layer}.attn_k_b.weight")  # [H, L, nope]
        v_b = self.read(f"blk.{layer}.attn_v_b.weight")  # [H, v, L]
        kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope+v, L]
        return kv.reshape(-1, kv.shape[-1]).contiguous()


def expert_tensor_names(layer: int) -> dict[str, str]:
    """{role: GGUF name} of one layer's stacked routed-expert tensors (biases only in gpt-oss; gate_up
    where the converter keeps gate and up fused)."""
    return {
        f"{role}{kind}": f"blk.{layer}.ffn_{role}_exps.{'weight' if kind == '' else 'bias'}"
        for role in ("gate", "up", "down", "gate_up") for kind in ("", "_bias")
    }


def expert_roles(quirks: ArchQuirks) -> tuple[str, ...]:
    """The stacked expert tensors a layer must have: gate, up, down; up and down without a gate."""
    return {"up": ("up", "down"), "fused": ("gate_up", "down")}.get(quirks.experts, ("gate", "up", "down"))


def fuse_experts(quirks: ArchQuirks, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert parameters from the dequantized GGUF parts.

    parts: gate, up [n, I, H]; down [n, H, I]; optional gate_bias, up_bias [n, I], down_bias [n, H].
    """
    if quirks.experts == "fused":
        return {"gate_up_proj": parts["gate_up"], "down_proj": parts["down"]}  # [n, 2I, H] (gate rows, then up), [n, H, I]
    gate, up, down = parts.get("gate"), parts["up"], parts["down"]
    if quirks.experts == "gate_up":
        return {"gate_up_proj": torch.cat([gate, up], dim=1), "down_proj": down}  # [n, 2I, H], [n, H, I]
    if quirks.experts == "up":
        return {"up_proj": up, "down_proj": down}  # [n, I, H], [n, H, I]
    n, inner, hidden = gate.shape
    gate_up = torch.empty(n, hidden, 2 * inner)  # [n, H, 2I], gate and up interleaved
    gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
    fused = {"gate_up_proj": gate_up, "down_proj": down.transpose(1, 2).contiguous()}  # down [n, I, H]
    if "gate_bias" in parts:
        bias = torch.empty(n, 2 * inner)
        bias[:, 0::2], bias[:, 1::2] = parts["gate_bias"], parts["up_bias"]
        fused["gate_up_proj_bias"] = bias
        fused["down_proj_bias"] = parts["down_bias"]
    return fused
