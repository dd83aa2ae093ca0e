"""The config table's entries for attention-only families: GGUF metadata -> transformers config keys.

Each entry returns the transformers model type and its shape keys (gguf_config.py adds the keys
every architecture shares, gguf_routing.py the routing keys). What GGUF does not record is taken
from how llama.cpp runs the architecture, so moeswarm computes what llama.cpp computes.
"""

from __future__ import annotations

from moeswarm.errors import ModelError
from moeswarm.gguf.gguf_file import GGUFFile


def experts(f: GGUFFile, count_key: str, used_key: str = "num_experts_per_tok") -> dict:
    return {count_key: int(f.require("expert_count")), used_key: int(f.require("expert_used_count"))}


def has(f: GGUFFile, tensor: str) -> bool:
    return tensor in f.tensors


def moe_layers(f: GGUFFile) -> set[int]:
    """Layers with a router or stacked expert tensors (a slice file has only the latter, of its layers)."""
    return {int(name.split(".")[1]) for name in f.tensors
            if name.startswith("blk.") and (".ffn_gate_inp." in name or "_exps." in name)}


def qwen2moe(f: GGUFFile) -> dict:
    return dict(experts(f, "num_experts"), model_type="qwen2_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                shared_expert_intermediate_size=int(f.get("expert_shared_feed_forward_length", 0)),
                qkv_bias=has(f, "blk.0.attn_q.bias"))


def qwen3moe(f: GGUFFile) -> dict:
    return dict(experts(f, "num_experts"), model_type="qwen3_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                attention_bias=has(f, "blk.0.attn_q.bias"))


def olmoe(f: GGUFFile) -> dict:
    return dict(experts(f, "num_experts"), model_type="olmoe", intermediate_size=int(
        f.get("expert_feed_forward_length", f.get("feed_forward_length"))))


def llama(f: GGUFFile) -> dict:
    if f.get("expert_count") in (None, 0):
        raise ModelError(f"{f.path}: a llama model without experts (not a MoE): nothing to swarm")
    return dict(experts(f, "num_local_experts"), model_type="mixtral",
                head_dim=int(f.get("rope.dimension_count", f.require("embedding_length") // f.require("attention.head_count"))))


def deepseek2(f: GGUFFile) -> dict:
    # deepseek_v3 (V3, R1, Kimi-K2, Moonlight, GLM-4.7-Flash) has a router bias and sigmoid scores;
    # V2 has neither (a slice file without its backbone has no router bias: the scores tell).
    v3 = any(name.endswith("exp_probs_b.bias") for name in f.tensors) or f.get("expert_gating_func") == 2
    heads = int(f.require("attention.head_count"))
    rope_dim = int(f.require("rope.dimension_count"))
    k_mla = f.get("attention.key_length_mla")
    return dict(experts(f, "n_routed_experts"), model_type="deepseek_v3" if v3 else "deepseek_v2",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                first_k_dense_replace=int(f.get("leading_dense_block_count", 0)),
                kv_lora_rank=int(f.require("attention.kv_lora_rank")),
                q_lora_rank=int(f.get("attention.q_lora_rank")) if f.get("attention.q_lora_rank") else None,
                qk_rope_head_dim=rope_dim,
                qk_nope_head_dim=int(k_mla) - rope_dim if k_mla else int(f.require("attention.key_length")) - rope_dim,
                v_head_dim=int(f.get("attention.value_length_mla", f.get("attention.value_length"))),
                num_key_value_heads=heads, head_dim=rope_dim)


def glm4moe(f: GGUFFile) -> dict:
    rope_dim = int(f.get("rope.dimension_count", 0))
    head_dim = int(f.get("attention.key_length"))
    # block_count includes the multi-token-prediction layers, which transformers' model does not run
    # (and a converted checkpoint without them has no tensors for them).
    nextn = int(f.get("nextn_predict_layers", 0))
    return dict(experts(f, "n_routed_experts"), model_type="glm4_moe",
                num_hidden_layers=int(f.require("block_count")) - nextn, num_nextn_predict_layers=nextn,
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                first_k_dense_replace=int(f.get("leading_dense_block_count", 0)),
                use_qk_norm=has(f, "blk.0.attn_q_norm.weight"),
                attention_bias=has(f, "blk.0.attn_q.bias"),
                partial_rotary_factor=rope_dim / head_dim if rope_dim else 0.5)


def gpt_oss(f: GGUFFile) -> dict:
    # gpt-oss's YaRN does not round the correction range to whole dimensions (`truncate: false` in
    # its HF config; the reference implementation does not either). GGUF has no key for it, and
    # llama.cpp's ggml_rope_yarn_corr_dims always rounds (floor/ceil): a ~1e-2 logit difference on
    # tiny models, so moeswarm follows the HF model here, not llama.cpp.
    return dict(experts(f, "num_local_experts"), model_type="gpt_oss",
                intermediate_size=int(f.require("expert_feed_forward_length")),
                sliding_window=int(f.get("attention.sliding_window", 128)), attention_bias=True,
                rope_extra={"truncate": False})


def granitemoe(f: GGUFFile) -> dict:
    # One GGUF architecture for GraniteMoE and GraniteMoE-Shared: the shared expert's tensors tell.
    shared = f.get("expert_shared_feed_forward_length")
    return dict(experts(f, "num_local_experts"), model_type="granitemoeshared" if shared else "granitemoe",
                intermediate_size=int(f.get("expert_feed_forward_length", f.require("feed_forward_length"))),
                **({"shared_intermediate_size": int(shared)} if shared else {}),
                embedding_multiplier=float(f.get("embedding_scale", 1.0)),
                residual_multiplier=float(f.get("residual_scale", 1.0)),
                attention_multiplier=float(f.get("attention.scale", 1.0)),
                logits_scaling=float(f.get("logit_scale", 1.0)),
                attention_bias=has(f, "blk.0.attn_q.bias"))


def dots1(f: GGUFFile) -> dict:
    return dict(experts(f, "n_routed_experts"), model_type="dots1",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                first_k_dense_replace=int(f.get("leading_dense_block_count", 0)),
                attention_bias=has(f, "blk.0.attn_q.bias"))


def ernie4_5_moe(f: GGUFFile) -> dict:
    return dict(experts(f, "moe_num_experts", "moe_k"), model_type="ernie4_5_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                moe_num_shared_experts=int(f.get("expert_shared_count", 0)),
                moe_layer_start_index=int(f.get("leading_dense_block_count", 0)),
                moe_layer_interval=int(f.get("interleave_moe_layer_step", 1)),
                use_bias=has(f, "blk.0.attn_q.bias"))


def minimax_m2(f: GGUFFile) -> dict:
    head_dim = int(f.require("attention.key_length"))
    return dict(experts(f, "num_local_experts"), model_type="minimax_m2",
                intermediate_size=int(f.require("expert_feed_forward_length")),
                partial_rotary_factor=int(f.get("rope.dimension_count", head_dim)) / head_dim)


def hunyuan_moe(f: GGUFFile) -> dict:
    # Hunyuan-A13B: its experts and its shared MLP are both `intermediate_size` wide.
    return dict(experts(f, "num_experts", "moe_topk"), model_type="hunyuan_v1_moe",
                intermediate_size=int(f.require("expert_feed_forward_length")),
                attention_bias=has(f, "blk.0.attn_q.bias"))


def afmoe(f: GGUFFile) -> dict:
    # Arcee Trinity: sliding-window attention with every 4th layer global (llama.cpp's pattern when
    # the file gives none), gated attention, and MuP embedding scaling, which llama.cpp always applies.
    return dict(experts(f, "num_experts"), model_type="afmoe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                num_shared_experts=int(f.get("expert_shared_count", 0)),
                num_dense_layers=int(f.get("leading_dense_block_count", 0)),
                sliding_window=int(f.get("attention.sliding_window", 1024)), global_attn_every_n_layers=4,
                mup_enabled=True)


def exaone_moe(f: GGUFFile) -> dict:
    # K-EXAONE: DeepSeek-V3-style routing, sliding-window layers where the file's pattern says so
    # (RoPE only there when there is a window), leading dense layers, MTP layers beyond block_count's text.
    nextn = int(f.get("nextn_predict_layers", 0))
    layers = int(f.require("block_count")) - nextn
    dense = int(f.get("leading_dense_block_count", 0))
    pattern = f.get("attention.sliding_window_pattern")
    return dict(experts(f, "num_experts"), model_type="exaone_moe", num_hidden_layers=layers,
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                num_shared_experts=int(f.get("expert_shared_count", 0)), first_k_dense_replace=dense,
                mlp_layer_types=["dense" if layer < dense else "sparse" for layer in range(layers)],
                sliding_window=int(f.get("attention.sliding_window", 4096)) if pattern else None,
                layer_types=["sliding_attention" if sliding else "full_attention" for sliding in (pattern or [False] * layers)][:layers])


def mellum(f: GGUFFile) -> dict:
    # Sliding-window layers where the file's pattern says so, each layer type with its own RoPE base.
    layers = int(f.require("block_count"))
    pattern = f.get("attention.sliding_window_pattern") or [False] * layers
    base = float(f.get("rope.freq_base", 10000.0))
    moe = moe_layers(f)
    return dict(experts(f, "num_local_experts"), model_type="mellum",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                layer_types=["sliding_attention" if sliding else "full_attention" for sliding in pattern],
                mlp_layer_types=["sparse" if layer in moe else "dense" for layer in range(layers)],
                sliding_window=int(f.get("attention.sliding_window", 1024)),
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": base},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": float(f.get("rope.freq_base_swa", base))}})


def hy_v3(f: GGUFFile) -> dict:
    layers, moe = int(f.require("block_count")), moe_layers(f)
    expert_ff = int(f.require("expert_feed_forward_length"))
    return dict(experts(f, "num_experts"), model_type="hy_v3", moe_intermediate_size=expert_ff,
                num_shared_experts=int(f.get("expert_shared_feed_forward_length", 0)) // expert_ff,
                mlp_layer_types=["sparse" if layer in moe else "dense" for layer in range(layers)])


def laguna(f: GGUFFile) -> dict:
    # Laguna: with a sliding window, layer 0 of every 4 global and the rest sliding (llama.cpp's
    # pattern; GGUF records none), each layer type with its own RoPE base and rotary width; gated
    # attention; per-layer head counts; leading dense layers.
    layers, head_dim = int(f.require("block_count")), int(f.require("attention.key_length"))
    window = int(f.get("attention.sliding_window", 0))
    heads = f.require("attention.head_count")
    dense = int(f.get("leading_dense_block_count", 0))
    base = float(f.get("rope.freq_base", 10000.0))
    rotary = int(f.get("rope.dimension_count", head_dim))
    return dict(experts(f, "num_experts"), model_type="laguna",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                shared_expert_intermediate_size=int(f.get("expert_shared_feed_forward_length", 0)),
                num_attention_heads_per_layer=[int(n) for n in heads] if isinstance(heads, list) else [int(heads)] * layers,
                mlp_layer_types=["dense" if layer < dense else "sparse" for layer in range(layers)],
                layer_types=["full_attention" if not window or layer % 4 == 0 else "sliding_attention" for layer in range(layers)],
                sliding_window=window or None,
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": rotary / head_dim},
                    "sliding_attention": {"rope_type": "default", "rope_theta": float(f.get("rope.freq_base_swa", base)),
                                          "partial_rotary_factor": int(f.get("rope.dimension_count_swa", rotary)) / head_dim}})


def cohere2moe(f: GGUFFile) -> dict:
    # Cohere2-MoE: parallel attention and MoE on one LayerNorm; sliding-window layers (with RoPE)
    # where the file's pattern says so, global ones without; the shared expert averaged with the
    # routed ones (llama.cpp hard-codes the 0.5).
    layers = int(f.require("block_count"))
    pattern = f.get("attention.sliding_window_pattern") or [False] * layers
    dense = int(f.get("leading_dense_block_count", 0))
    return dict(experts(f, "num_experts"), model_type="cohere2_moe",
                intermediate_size=int(f.require("expert_feed_forward_length")),  # experts; shared: x num_shared
                num_shared_experts=int(f.get("expert_shared_count", 0)), shared_expert_combination_strategy="average",
                layer_norm_eps=float(f.get("attention.layer_norm_epsilon", 1e-5)),
                # LayerNorm unless the file gives an RMS epsilon (llama.cpp's rule; transformers': rms_norm_eps None)
                rms_norm_eps=float(rms) if (rms := f.get("attention.layer_norm_rms_epsilon")) is not None else None,
                logit_scale=float(f.get("logit_scale", 1.0)), sliding_window=int(f.get("attention.sliding_window", 4096)),
                layer_types=["sliding_attention" if sliding else "full_attention" for sliding in pattern],
                mlp_layer_types=["dense" if layer < dense else "sparse" for layer in range(layers)])


def granite_swa(f: GGUFFile) -> dict:
    # Granite with sliding-window layers (the file's pattern), a learnt attention sink per head, RoPE
    # where `attention.rope_pattern` says (every layer when absent), and its fused shared MLP.
    layers = int(f.require("block_count"))
    pattern = f.get("attention.sliding_window_pattern") or [False] * layers
    rope = f.get("attention.rope_pattern") or [True] * layers
    base = float(f.get("rope.freq_base", 10000.0))
    return dict(granitemoe(f), model_type="granitemoe_swa", sliding_window=int(f.require("attention.sliding_window")),
                layer_types=["sliding_attention" if sliding else "full_attention" for sliding in pattern],
                layer_rope_theta=[base if uses else 0.0 for uses in rope])
