"""The config table's entries for hybrid families: attention plus recurrent (gated-delta, Mamba) or
short-convolution layers, each layer's kind read from the GGUF metadata.
"""

from __future__ import annotations

from moeswarm.gguf.gguf_config_families import experts, granitemoe, moe_layers
from moeswarm.gguf.gguf_file import GGUFFile


def qwen3next(f: GGUFFile) -> dict:
    # Gated-delta linear attention in the layers `attention.recurrent_layers` marks, full attention
    # (with an output gate in q_proj) in the others.
    head_dim = int(f.require("attention.key_length"))
    value_heads = int(f.require("ssm.time_step_rank"))
    recurrent = f.require("attention.recurrent_layers")
    return dict(experts(f, "num_experts"), model_type="qwen3_next",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                shared_expert_intermediate_size=int(f.get("expert_shared_feed_forward_length", 0)),
                layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
                linear_conv_kernel_dim=int(f.require("ssm.conv_kernel")),
                linear_key_head_dim=int(f.require("ssm.state_size")),
                linear_num_key_heads=int(f.require("ssm.group_count")),
                linear_num_value_heads=value_heads,
                linear_value_head_dim=int(f.require("ssm.inner_size")) // value_heads,
                partial_rotary_factor=int(f.require("rope.dimension_count")) / head_dim)


def qwen35moe(f: GGUFFile) -> dict:
    # Qwen3-Next's layout with separate q/k/v, z, a, b projections; text positions make its
    # interleaved multimodal RoPE the plain one (transformers' default sections are llama.cpp's).
    sections = [int(n) for n in f.require("rope.dimension_sections")]
    return dict(qwen3next(f), model_type="qwen3_5_moe_text", mrope_section=sections[:3])


def attention_layers(f: GGUFFile, other: str) -> list[str]:
    """layer_types of a hybrid whose non-attention layers have no kv heads in `attention.head_count_kv`."""
    return ["full_attention" if heads else other for heads in f.require("attention.head_count_kv")]


def lfm2moe(f: GGUFFile) -> dict:
    # Short-convolution layers where `attention.head_count_kv` is 0, attention in the others.
    return dict(experts(f, "num_experts"), model_type="lfm2_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                num_dense_layers=int(f.get("leading_dense_block_count", 0)),
                layer_types=attention_layers(f, "conv"), conv_L_cache=int(f.require("shortconv.l_cache")),
                norm_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-5)))


def granitehybrid(f: GGUFFile) -> dict:
    # Granite 4 (-H): Mamba-2 layers where `attention.head_count_kv` is 0; llama.cpp applies RoPE
    # unless `rope.scaling.finetuned` is false, transformers when position_embedding_type is "rope".
    inner, heads = int(f.require("ssm.inner_size")), int(f.require("ssm.time_step_rank"))
    return dict(granitemoe(f), model_type="granitemoehybrid", layer_types=attention_layers(f, "linear_attention"),
                mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_d_state=int(f.require("ssm.state_size")),
                mamba_n_groups=int(f.require("ssm.group_count")), mamba_d_conv=int(f.require("ssm.conv_kernel")),
                mamba_expand=inner // int(f.require("embedding_length")),
                position_embedding_type="rope" if f.get("rope.scaling.finetuned", True) else None)


def nemotron_h_moe(f: GGUFFile) -> dict:
    # Nemotron-H MoE (Nemotron 3): per layer, attention where it has kv heads, MoE where it has a
    # feed-forward length, Mamba-2 elsewhere; experts are squared-ReLU up/down (no gate).
    kv_heads, feed_forward = f.require("attention.head_count_kv"), f.require("feed_forward_length")
    inner, heads = int(f.require("ssm.inner_size")), int(f.require("ssm.time_step_rank"))
    return dict(experts(f, "n_routed_experts"), model_type="nemotron_h",
                layers_block_type=["full_attention" if kv else "moe" if ff else "linear_attention"
                                   for kv, ff in zip(kv_heads, feed_forward)],
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                moe_shared_expert_intermediate_size=int(f.get("expert_shared_feed_forward_length", 0)),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                mamba_num_heads=heads, mamba_head_dim=inner // heads, ssm_state_size=int(f.require("ssm.state_size")),
                n_groups=int(f.require("ssm.group_count")), conv_kernel=int(f.require("ssm.conv_kernel")),
                expand=inner // int(f.require("embedding_length")),
                layer_norm_epsilon=float(f.get("attention.layer_norm_epsilon", 1e-5)))


def period(layers: list[int], count: int) -> tuple[int, int]:
    """(period, offset) of evenly spaced layer indices (Jamba's attention and expert layers)."""
    if not layers:
        return count + 1, count  # none
    return (layers[1] - layers[0] if len(layers) > 1 else count), layers[0]


def jamba(f: GGUFFile) -> dict:
    # Mamba layers where `attention.head_count_kv` is 0; experts in the layers that have a router
    # or stacked expert tensors (dense MLPs in the others); GGUF records neither period.
    count = int(f.require("block_count"))
    attention = [layer for layer, heads in enumerate(f.require("attention.head_count_kv")) if heads]
    moe = sorted(moe_layers(f))
    (attn_period, attn_offset), (expert_period, expert_offset) = period(attention, count), period(moe, count)
    inner = int(f.require("ssm.inner_size"))
    return dict(experts(f, "num_experts"), model_type="jamba",
                attn_layer_period=attn_period, attn_layer_offset=attn_offset,
                expert_layer_period=expert_period, expert_layer_offset=expert_offset,
                mamba_d_state=int(f.require("ssm.state_size")), mamba_d_conv=int(f.require("ssm.conv_kernel")),
                mamba_expand=inner // int(f.require("embedding_length")), mamba_dt_rank=int(f.require("ssm.time_step_rank")),
                use_mamba_kernels=False)
