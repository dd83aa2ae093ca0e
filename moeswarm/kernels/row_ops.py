"""A GGUF backbone's RMSNorms and rotary embeddings in one C call each (qk_rows.c).

At a decode step a real-dimension backbone's matrices are a few C calls per layer, and what is left
of its time is PyTorch's per-operation cost: transformers' RMSNorm is 6 tensor operations and its
rotary embedding 10, at several microseconds each for one row. `use_row_ops` replaces them where
they are the plain ones, recognised by their bytecode being that of transformers' Llama (the
families that copy it: OLMoE, Qwen3-MoE, Mixtral, DeepSeek, ...); anything else keeps its own code.

- **Rotary**: `qk_rope` gives torch's bits exactly (elementwise, the same IEEE operations), so the
  family module's `apply_rotary_pos_emb` is swapped process-wide; anything but float32 [B, H, T, D]
  with cos, sin [B, T, D] goes to the original.
- **Rotary tables**: transformers' rotary module computes cos and sin with torch's elementwise
  functions, which split a prompt's table among torch's threads; at real dimensions with workers,
  about 1 prompt in 30 got the table's second half (positions 26-51 of 52) about 4.5e-5 smaller
  than usual, in the backbone alone (the local reference's table was torch's usual one), and that
  changed the attention's output and once a token. `RowRotaryEmbedding` computes each
  position's values alone, in the calling thread, from double precision (`qk_rope_table`): every
  model moeswarm builds (model/skeleton.py: backbones, references and stages, from HF directories
  and GGUF files alike) has its plain rotary modules (Llama's forward, a rope type without dynamic
  updates) replaced by it.
- **RMSNorm**: `qk_rms_norm` sums the squares in its own fixed order, so its bits differ from
  torch's in the last place (torch's own differ between AVX2 and AVX-512 builds of its kernels).
  Each module of a GGUF backbone kept in the file's encoding is replaced by `RowRMSNorm`, as the
  routers' float products are made row-invariant there (row_invariant.py): the local reference is
  loaded the same way, so `--check-local` compares like with like, and a row's bits depend on that
  row only, whatever the batch or the thread count.

Legend: d = hidden (normalized) size, B = batch, H = heads, T = tokens, D = head size.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch
from transformers.models.llama import modeling_llama as llama

from moeswarm.kernels import qkernels


def _same_code(function, canonical) -> bool:
    """Whether `function` compiles to `canonical`'s bytecode (a verbatim copy, docstring aside)."""
    a, b = function.__code__, canonical.__code__
    return (a.co_code == b.co_code and a.co_names == b.co_names and a.co_varnames == b.co_varnames
            and _constants(function) == _constants(canonical))


def _constants(function) -> tuple:
    constants = function.__code__.co_consts
    return constants[1:] if function.__doc__ is not None and constants[:1] == (function.__doc__,) else constants


class RowRMSNorm(torch.nn.Module):
    """y = w * (x * (1 / sqrt(mean(x^2) + eps))) per row of d values, one C call for float32 x."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = weight  # [d] float32
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.weight.shape[0]
        if x.dtype != torch.float32 or x.shape[-1] != d or x.requires_grad:
            raise ValueError(f"RowRMSNorm takes float32 rows of {d} values, got {x.dtype} {list(x.shape)}")
        flat = x.reshape(-1, d)  # [N, d]
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        qkernels.rms_norm(flat, self.weight, self.variance_epsilon, y)
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _is_plain_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (_same_code(type(module).forward, llama.LlamaRMSNorm.forward) and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and weight.dtype == torch.float32 and not weight.is_meta
            and isinstance(getattr(module, "variance_epsilon", None), float))


class RowRotaryEmbedding(torch.nn.Module):
    """A plain rotary module's (cos, sin) [B, T, D] for position_ids [B, T], from qk_rope_table.

    The module it replaces stays reachable for what the family's code reads from it besides its
    forward (its `config`: GraniteMoE-SWA keys its tables by `rotary_emb.config`'s rope_theta), and
    for its rope_type and attention_scaling."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.register_buffer("inv_freq", module.inv_freq, persistent=False)  # [D / 2] float32
        object.__setattr__(self, "replaced", module)  # not a submodule: its buffers are not the model's twice

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "replaced" not in self.__dict__:
                raise
            return getattr(self.__dict__["replaced"], name)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.is_floating_point() or position_ids.is_complex() or x.device.type != "cpu":
            raise ValueError(f"RowRotaryEmbedding takes integer positions on the CPU, got {position_ids.dtype} "
                             f"for {x.device} hidden states")
        cos, sin = qkernels.rope_table(position_ids.to(torch.int64), self.inv_freq, float(self.attention_scaling))
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        return f"{self.rope_type}, pairs={self.inv_freq.shape[0]}, scaling={self.attention_scaling}"


def _is_plain_rotary(module: torch.nn.Module) -> bool:
    """Llama's forward (under its decorators) with a rope type whose frequencies never change."""
    forward = getattr(type(module), "forward", None)
    inv_freq, rope_type = getattr(module, "inv_freq", None), getattr(module, "rope_type", None)
    return (forward is not None and _same_code(inspect.unwrap(forward), inspect.unwrap(llama.LlamaRotaryEmbedding.forward))
            and isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
            and isinstance(inv_freq, torch.Tensor) and inv_freq.dim() == 1 and inv_freq.dtype == torch.float32
            and not inv_freq.is_meta and isinstance(getattr(module, "attention_scaling", None), (int, float)))


def _rope_pair(original: Callable) -> Callable:
    """apply_rotary_pos_emb(q, k, cos, sin) on qk_rope where the shapes are the plain ones."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and _fits(q, cos, sin) and _fits(k, cos, sin):
            return qkernels.rope(q, cos, sin), qkernels.rope(k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def _fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [B, H, T, D], cos and sin [B, T, D]: float32 on the CPU, x's last dimension contiguous."""
    return (x.dim() == 4 and cos.dim() == 3 and x.dtype == cos.dtype == sin.dtype == torch.float32
            and cos.shape == sin.shape == (x.shape[0], x.shape[2], x.shape[3]) and x.shape[3] % 2 == 0
            and x.stride(3) == 1 and not (x.requires_grad or cos.requires_grad) and x.device.type == "cpu")


def _use_rope(family) -> bool:
    current = getattr(family, "apply_rotary_pos_emb", None)
    if current is None or hasattr(current, "original"):
        return current is not None
    if not (_same_code(current, llama.apply_rotary_pos_emb) and _same_code(family.rotate_half, llama.rotate_half)):
        return False
    family.apply_rotary_pos_emb = _rope_pair(current)
    return True


def use_rotary_tables(model: torch.nn.Module) -> list[str]:
    """Replace `model`'s plain rotary modules by RowRotaryEmbedding (in place); the names replaced."""
    if not qkernels.available():
        return []
    tables = [name for name, module in model.named_modules() if _is_plain_rotary(module)]
    for name in tables:
        module = model.get_submodule(name)
        model.set_submodule(name, RowRotaryEmbedding(module))
    return tables


def use_row_ops(model: torch.nn.Module) -> list[str]:
    """Replace `model`'s plain RMSNorms by RowRMSNorm (in place) and swap its family's plain rotary
    embedding for qk_rope's (process-wide: the same bits). Returns what was replaced: module names,
    and "rotary" where it was. (Its rotary tables were replaced when it was built: use_rotary_tables.)"""
    if not qkernels.available():
        return []
    replaced = [name for name, module in model.named_modules() if _is_plain_rms_norm(module)]
    for name in replaced:
        module = model.get_submodule(name)
        model.set_submodule(name, RowRMSNorm(module.weight, module.variance_epsilon))
    family = sys.modules.get(type(model).__module__)
    if family is not None and _use_rope(family):
        replaced.append("rotary")
    return replaced
