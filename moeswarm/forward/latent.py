"""Multi-head latent attention in packed forwards, absorbed: the cache is never expanded.

DeepSeek V2/V3's attention caches, per position, a latent c [r] (after its norm) and a rotary key
part k_rot [rope]; the model's module then expands every cached position at every step (its
`expand_kv`): kv_b_proj maps c to each head's k_nope [nope] and value [v], and the keys are
[k_nope | k_rot]. That is r x H x (nope + v) multiply-adds per cached position per layer per step:
16.8M at DeepSeek-V3's shape (512 x 128 x 256), 17 G a layer a step at 1,024 positions.

Absorbed, as llama.cpp computes MLA: with W_uk [H, nope, r] and W_uv [H, v, r] the rows of
kv_b_proj, q_nope . (W_uk c) = (q_nope W_uk) . c and sum_s p_s (W_uv c_s) = W_uv (sum_s p_s c_s).
So each head attends, with the query [q_nope W_uk | q_rot] ([r + rope]), to the keys [c | k_rot]
and the values c, one key/value head shared by all (the model's own attention function), and its
r-wide output goes through W_uv. Per cached position that is (2 r + rope) x H. The sums differ
from the expanded form's in the last places; the local reference takes the same path
(`--check-local` compares like with like).

Absorbed wins by far for few queries and loses for long chunks (docs/measured.md, "latent").
A long chunk's many queries each pay 2 r + rope a position where the expanded keys cost
nope + rope + v, and the expansion is paid once for them all. So a step's layer runs absorbed
only where that takes fewer multiply-adds (`Shape.absorbs_cheaper`, from the step's layout
alone: the local reference decides the same): decode tokens, drafts and later chunks absorbed, a
prompt's first chunk expanded. Several queries fold their heads into rows against the one key
head (`attend`): one product over the shared keys, never H copies of them.

A GGUF file's module multiplies by W_uk and W_uv as the file stores them (attn_k_b, attn_v_b:
kernels/gguf_latent.py), with int8 activations, as llama.cpp does: kv_b_proj's float32 copy is
7x their blocks' bytes (18.4 against 2.8 MB a layer at GLM-4.7-Flash's shape), read at every step.
Such a module absorbs at every step, prompts included (`Shape.absorbs_cheaper` says why).

It applies to a module whose `expand_kv` is the expansion above (DeepSeek V2/V3, GLM-4.7-Flash,
AXK1: the same source) with a float kv_b_proj; `install` makes the module's `expand_kv` pass a
packed forward's latents through when they are marked so (`pass_latents`), and
forward/packed.py's attention calls `query` and `output` around the model's attention
function. Any other latent module is expanded as the model does it.

Legend: T = the step's tokens, S = positions attended, H = heads, r = kv_lora_rank, rope = the
rotary part, nope = the key part without it, v = value head size.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from moeswarm.model.attention_threads import one_torch_thread
from moeswarm.kernels.gguf_latent import BLOCKS, HeadMatrices

# set on a module whose attention may run absorbed: (W_uk, W_uv transposed) as views of kv_b_proj's
# rows, or (W_uk, W_uv) in a GGUF file's blocks (HeadMatrices)
ABSORBED = "_moeswarm_absorbed"
# The blocks' products run on one thread: each is small, and a helper woken per product costs more
# than its half saves (docs/measured.md, "latent").
SMALL_PRODUCT_THREADS = 1
_PACKED = "_moeswarm_packed_latents"  # set on the latents a packed forward's cache hands the module


@dataclass(frozen=True)
class Shape:
    """An absorbing module's sizes: r, nope, rope, v (per head; the head count scales both forms alike)."""

    rank: int
    nope: int
    rope: int
    value: int
    blocks: bool = False  # W_uk and W_uv in a GGUF file's blocks: every step absorbs (below)

    def absorbs_cheaper(self, rows: int, positions: int, pairs: int) -> bool:
        """Whether a layer's step costs fewer multiply-adds absorbed: `rows` queries (T), `positions`
        the contexts' total (sum p + n), `pairs` sum over segments of queries x positions.

        With the file's blocks, always: the absorbed products are int8 dots on the blocks, while the
        expansion multiplies by kv_b_proj's float32 rows (kernels/row_invariant.py's path, for bits
        that hold whatever the rows), several times slower a multiply-add (docs/measured.md,
        "latent")."""
        if self.blocks:
            return True
        mapped = self.rank * (self.nope + self.value)  # W_uk and W_uv: per query absorbed, per position expanded
        expanded = positions * mapped + pairs * (self.nope + self.rope + self.value)
        absorbed = rows * mapped + pairs * (2 * self.rank + self.rope)
        return absorbed < expanded


def shape_of(module: torch.nn.Module) -> Shape | None:
    """The sizes of `module`'s latent attention if it can run absorbed, else None."""
    if not absorbs(module):
        return None
    return Shape(module.kv_lora_rank, module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim,
                 getattr(module, BLOCKS, None) is not None)


def absorbs(module: torch.nn.Module) -> bool:
    """Whether `module`'s latent attention can run absorbed (its expansion is the one above)."""
    projection = getattr(module, "kv_b_proj", None)
    return (isinstance(projection, torch.nn.Linear) and projection.bias is None
            and projection.weight.dtype == torch.float32 and _expands_as_deepseek(type(module))
            and all(hasattr(module, name) for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                      "kv_lora_rank", "num_heads")))


@functools.cache
def _expands_as_deepseek(module: type) -> bool:
    try:
        source = inspect.getsource(module.expand_kv)
    except (AttributeError, OSError, TypeError):
        return False
    return ("self.kv_b_proj(kv_nope).view(key_shape).transpose(1, 2)" in source
            and "torch.split(kv_nope, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)" in source
            and "key_states[..., : self.qk_nope_head_dim].copy_(k_nope)" in source)


def install(module: torch.nn.Module) -> None:
    """Let `module` run absorbed in packed forwards: its weights split once, its `expand_kv` passing
    a packed forward's latents through (any other call expands as before)."""
    if getattr(module, ABSORBED, None) is not None:
        return
    blocks = getattr(module, BLOCKS, None)
    if blocks is not None:
        setattr(module, ABSORBED, blocks)
    else:
        nope, v = module.qk_nope_head_dim, module.v_head_dim
        weight = module.kv_b_proj.weight.detach().as_subclass(torch.Tensor)  # [H (nope + v), r]
        per_head = weight.reshape(module.num_heads, nope + v, -1)
        # views of kv_b_proj's own rows, not copies: 67 MB a layer at DeepSeek-V3's shape (float32)
        setattr(module, ABSORBED, (per_head[:, :nope], per_head[:, nope:].transpose(1, 2)))  # [H, nope, r], [H, r, v]
    expand = module.expand_kv

    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor):
        return (kv_nope, k_rot) if passed(kv_nope) else expand(kv_nope, k_rot)

    module.expand_kv = expand_kv


def pass_latents(latents: torch.Tensor) -> torch.Tensor:
    """Mark `latents` (a packed forward's, fresh from the cache) for the module to pass through."""
    setattr(latents, _PACKED, True)
    return latents


def passed(latents: torch.Tensor) -> bool:
    """Whether the module passed `latents` through unexpanded (the attention runs absorbed)."""
    return getattr(latents, _PACKED, False)


def query(module: torch.nn.Module, query_states: torch.Tensor) -> torch.Tensor:
    """[1, H, T, nope + rope] -> [1, H, T, r + rope]: q_nope through W_uk, the rotary part as it is."""
    w_uk, _ = getattr(module, ABSORBED)
    nope = module.qk_nope_head_dim
    if isinstance(w_uk, HeadMatrices):
        rows = query_states[0, :, :, :nope].transpose(0, 1).contiguous()  # [T, H, nope]
        absorbed = w_uk.product(rows, SMALL_PRODUCT_THREADS).transpose(0, 1).unsqueeze(0)  # [1, H, T, r]
    else:
        with one_torch_thread():
            absorbed = torch.matmul(query_states[..., :nope], w_uk)  # [1, H, T, r]
    return torch.cat([absorbed, query_states[..., nope:]], dim=-1)


def keys(latents: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """[1, 1, S, r] and [1, 1, S, rope] -> the keys every head attends to, [1, 1, S, r + rope]."""
    return torch.cat([latents, rotary], dim=-1)


def attend(module: torch.nn.Module, inner, query_states: torch.Tensor, keys_states: torch.Tensor,
           latents: torch.Tensor, mask: torch.Tensor | None, **kwargs) -> torch.Tensor:
    """One segment's absorbed attention through the model's attention function `inner`: query
    [1, H, n, r + rope], keys [1, 1, S, r + rope], latents (the values) [1, 1, S, r], mask
    [1, 1, n, S] or None (one query) -> [1, n, H, r].

    One query goes as it is (every head to the one key head: qkernels' one-query call reads it
    so). Several fold their heads into the rows, [1, 1, H n, r + rope] against the one key head,
    each row's mask its query's: one product over the shared keys, never H copies of them."""
    heads, n = query_states.shape[1], query_states.shape[2]
    if n == 1 and mask is None:
        out, _ = inner(module, query_states, keys_states, latents, None, **kwargs)
        return out  # [1, 1, H, r]
    folded = query_states.reshape(1, 1, heads * n, query_states.shape[-1])  # row h n + i: head h, query i
    rows_mask = mask[:, :, None].expand(1, 1, heads, n, mask.shape[-1]).reshape(1, 1, heads * n, -1)
    out, _ = inner(module, folded, keys_states, latents, rows_mask, **kwargs)  # [1, H n, 1, r]
    return out.reshape(1, heads, n, -1).transpose(1, 2)  # [1, n, H, r]


def output(module: torch.nn.Module, attended: torch.Tensor) -> torch.Tensor:
    """[1, T, H, r] (the attention over the latents) -> [1, T, H, v] through W_uv."""
    _, w_uv_t = getattr(module, ABSORBED)
    if isinstance(w_uv_t, HeadMatrices):  # W_uv itself, in blocks
        return w_uv_t.product(attended[0].contiguous(), SMALL_PRODUCT_THREADS).unsqueeze(0)  # [1, T, H, v]
    with one_torch_thread():
        out = torch.matmul(attended.transpose(1, 2), w_uv_t)  # [1, H, T, v]
    return out.transpose(1, 2).contiguous()
