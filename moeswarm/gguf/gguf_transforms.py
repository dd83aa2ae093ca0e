"""Inverses of what llama.cpp's converter does to a tensor's values (the names table's `transforms`).

Each takes the tensor as read from the file and the model's transformers config, and returns the
tensor as the transformers parameter holds it. Where the converter computed in floating point
(exp, +1), the inverse is exact to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch


def zero_centered_norm(tensor: torch.Tensor, config) -> torch.Tensor:
    """Qwen3-Next's RMSNorms scale by (1 + weight); the converter stored weight + 1."""
    return tensor - 1


def a_log(tensor: torch.Tensor, config) -> torch.Tensor:
    """Gated-delta decay: the converter stored ssm_a = -exp(A_log)."""
    return torch.log(-tensor)


def qkvz_per_key_head(tensor: torch.Tensor, config) -> torch.Tensor:
    """in_proj_qkvz [Hk*(2dk + 2r*dv), H] from attn_qkv then attn_gate rows.

    The converter regrouped transformers' per-key-head rows [q_h, k_h, v_h, z_h] (h < Hk; v and z
    hold r = Hv/Hk value heads each) into [q_0..q_Hk, k_.., v_.., z_..]; this puts them back.
    """
    key_heads, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_value = config.linear_num_value_heads // key_heads * config.linear_value_head_dim  # r*dv
    hidden = tensor.shape[-1]
    q, k, v, z = torch.split(tensor, [key_heads * dk, key_heads * dk, key_heads * per_value, key_heads * per_value])
    parts = [part.reshape(key_heads, -1, hidden) for part in (q, k, v, z)]  # [Hk, rows per head, H] each
    return torch.cat(parts, dim=1).reshape(-1, hidden).contiguous()  # [Hk*(2dk+2r*dv), H]


def _grouped(tensor: torch.Tensor, config, dim: int, head_dim: int, offset: int = 0) -> torch.Tensor:
    """Undo the converter's V-head reorder along `dim` from `offset` on: llama.cpp stores value heads
    tiled ([K0, K1, .., K0, K1, ..]), transformers grouped by key head ([G0_v0..v(r-1), G1_v0, ..])."""
    key_heads = config.linear_num_key_heads
    per_key = config.linear_num_value_heads // key_heads  # r
    head, tail = tensor.narrow(dim, 0, offset), tensor.narrow(dim, offset, tensor.shape[dim] - offset)
    shape = list(tail.shape)
    tiled = tail.reshape(*shape[:dim], per_key, key_heads, head_dim, *shape[dim + 1:])  # [.., r, Hk, d, ..]
    grouped = tiled.transpose(dim, dim + 1).reshape(shape)  # [.., Hk, r, d, ..] flattened
    return torch.cat([head, grouped], dim=dim).contiguous()


def qkv_value_rows(tensor: torch.Tensor, config) -> torch.Tensor:
    """in_proj_qkv [2*Hk*dk + Hv*dv, H], and conv1d's channels: only the value rows were reordered."""
    offset = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    return _grouped(tensor, config, 0, config.linear_value_head_dim, offset)


def value_rows(tensor: torch.Tensor, config) -> torch.Tensor:
    """in_proj_z [Hv*dv, H]."""
    return _grouped(tensor, config, 0, config.linear_value_head_dim)


def value_columns(tensor: torch.Tensor, config) -> torch.Tensor:
    """out_proj [H, Hv*dv]."""
    return _grouped(tensor, config, 1, config.linear_value_head_dim)


def value_heads(tensor: torch.Tensor, config) -> torch.Tensor:
    """in_proj_a / in_proj_b [Hv, H], A_log / dt_bias [Hv]: one row per value head."""
    return _grouped(tensor, config, 0, 1)
