"""GGUF metadata -> a transformers config, per architecture.

GGUF records what llama.cpp needs to run the model (`{arch}.block_count`, `.expert_count`...);
each entry of the config table below says which transformers family an architecture is and how
its shapes are named there. Routing keys come from the routing table (gguf_routing.py), tensor
names from the names table (gguf_names.py); which architectures are supported, and why the others
are not, is gguf_support.py. What GGUF does not record is taken from how llama.cpp runs that
architecture, so moeswarm computes what llama.cpp computes.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import AutoConfig, PretrainedConfig

from moeswarm.errors import ModelError
from moeswarm.weights.gguf_file import GGUFFile
from moeswarm.weights.gguf_routing import routing_from_gguf
from moeswarm.weights.gguf_support import require_supported


def _common(f: GGUFFile) -> dict:
    head_counts = f.require("attention.head_count")
    heads = int(max(head_counts) if isinstance(head_counts, list) else head_counts)  # per layer in some
    hidden = int(f.require("embedding_length"))
    kv_heads = f.get("attention.head_count_kv", heads)
    config = dict(
        hidden_size=hidden,
        num_hidden_layers=int(f.require("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads if not isinstance(kv_heads, list) else max(kv_heads)),  # per layer in hybrids
        head_dim=int(f.get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(f.get("context_length", 4096)),
        rms_norm_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=_vocab_size(f),
        tie_word_embeddings="output.weight" not in f.tensors,
        rope_parameters={"rope_type": "default", "rope_theta": float(f.get("rope.freq_base", 10000.0))},
        dtype="float32",
    )
    if (intermediate := f.get("feed_forward_length")) is not None:
        config["intermediate_size"] = int(max(intermediate) if isinstance(intermediate, list) else intermediate)
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        value = f.metadata.get(f"tokenizer.ggml.{gguf_key}")
        config[key] = int(value) if value is not None else None
    return config


def _vocab_size(f: GGUFFile) -> int:
    if "token_embd.weight" in f.tensors:
        return int(f.tensors["token_embd.weight"].shape[1])  # ne = [hidden, vocab]
    if (size := f.get("vocab_size")) is not None:
        return int(size)
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelError(f"{f.path}: cannot tell the vocabulary size (no token_embd.weight, no tokenizer)")
    return len(tokens)


def _experts(f: GGUFFile, count_key: str, used_key: str = "num_experts_per_tok") -> dict:
    return {count_key: int(f.require("expert_count")), used_key: int(f.require("expert_used_count"))}


def _has(f: GGUFFile, tensor: str) -> bool:
    return tensor in f.tensors


def _qwen2moe(f: GGUFFile) -> dict:
    return dict(_experts(f, "num_experts"), model_type="qwen2_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                shared_expert_intermediate_size=int(f.get("expert_shared_feed_forward_length", 0)),
                qkv_bias=_has(f, "blk.0.attn_q.bias"))


def _qwen3moe(f: GGUFFile) -> dict:
    return dict(_experts(f, "num_experts"), model_type="qwen3_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                attention_bias=_has(f, "blk.0.attn_q.bias"))


def _olmoe(f: GGUFFile) -> dict:
    return dict(_experts(f, "num_experts"), model_type="olmoe", intermediate_size=int(
        f.get("expert_feed_forward_length", f.get("feed_forward_length"))))


def _llama(f: GGUFFile) -> dict:
    if f.get("expert_count") in (None, 0):
        raise ModelError(f"{f.path}: a llama model without experts (not a MoE): nothing to swarm")
    return dict(_experts(f, "num_local_experts"), model_type="mixtral",
                head_dim=int(f.get("rope.dimension_count", f.require("embedding_length") // f.require("attention.head_count"))))


def _deepseek2(f: GGUFFile) -> dict:
    # deepseek_v3 (V3, R1, Kimi-K2, Moonlight, GLM-4.7-Flash) has a router bias and sigmoid scores;
    # V2 has neither (a slice file without its backbone has no router bias: the scores tell).
    v3 = any(name.endswith("exp_probs_b.bias") for name in f.tensors) or f.get("expert_gating_func") == 2
    heads = int(f.require("attention.head_count"))
    rope_dim = int(f.require("rope.dimension_count"))
    k_mla = f.get("attention.key_length_mla")
    return dict(_experts(f, "n_routed_experts"), model_type="deepseek_v3" if v3 else "deepseek_v2",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                first_k_dense_replace=int(f.get("leading_dense_block_count", 0)),
                kv_lora_rank=int(f.require("attention.kv_lora_rank")),
                q_lora_rank=int(f.get("attention.q_lora_rank")) if f.get("attention.q_lora_rank") else None,
                qk_rope_head_dim=rope_dim,
                qk_nope_head_dim=int(k_mla) - rope_dim if k_mla else int(f.require("attention.key_length")) - rope_dim,
                v_head_dim=int(f.get("attention.value_length_mla", f.get("attention.value_length"))),
                num_key_value_heads=heads, head_dim=rope_dim)


def _glm4moe(f: GGUFFile) -> dict:
    rope_dim = int(f.get("rope.dimension_count", 0))
    head_dim = int(f.get("attention.key_length"))
    # block_count includes the multi-token-prediction layers, which transformers' model does not run
    # (and a converted checkpoint without them has no tensors for them).
    nextn = int(f.get("nextn_predict_layers", 0))
    return dict(_experts(f, "n_routed_experts"), model_type="glm4_moe",
                num_hidden_layers=int(f.require("block_count")) - nextn, num_nextn_predict_layers=nextn,
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                first_k_dense_replace=int(f.get("leading_dense_block_count", 0)),
                use_qk_norm=_has(f, "blk.0.attn_q_norm.weight"),
                attention_bias=_has(f, "blk.0.attn_q.bias"),
                partial_rotary_factor=rope_dim / head_dim if rope_dim else 0.5)


def _gpt_oss(f: GGUFFile) -> dict:
    # gpt-oss's YaRN does not round the correction range to whole dimensions (`truncate: false` in
    # its HF config; the reference implementation does not either). GGUF has no key for it, and
    # llama.cpp's ggml_rope_yarn_corr_dims always rounds (floor/ceil): a ~1e-2 logit difference on
    # tiny models, so moeswarm follows the HF model here, not llama.cpp.
    return dict(_experts(f, "num_local_experts"), model_type="gpt_oss",
                intermediate_size=int(f.require("expert_feed_forward_length")),
                sliding_window=int(f.get("attention.sliding_window", 128)), attention_bias=True,
                rope_extra={"truncate": False})


def _granitemoe(f: GGUFFile) -> dict:
    # One GGUF architecture for GraniteMoE and GraniteMoE-Shared: the shared expert's tensors tell.
    shared = f.get("expert_shared_feed_forward_length")
    return dict(_experts(f, "num_local_experts"), model_type="granitemoeshared" if shared else "granitemoe",
                intermediate_size=int(f.get("expert_feed_forward_length", f.require("feed_forward_length"))),
                **({"shared_intermediate_size": int(shared)} if shared else {}),
                embedding_multiplier=float(f.get("embedding_scale", 1.0)),
                residual_multiplier=float(f.get("residual_scale", 1.0)),
                attention_multiplier=float(f.get("attention.scale", 1.0)),
                logits_scaling=float(f.get("logit_scale", 1.0)),
                attention_bias=_has(f, "blk.0.attn_q.bias"))


def _dots1(f: GGUFFile) -> dict:
    return dict(_experts(f, "n_routed_experts"), model_type="dots1",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                first_k_dense_replace=int(f.get("leading_dense_block_count", 0)),
                attention_bias=_has(f, "blk.0.attn_q.bias"))


def _ernie4_5_moe(f: GGUFFile) -> dict:
    return dict(_experts(f, "moe_num_experts", "moe_k"), model_type="ernie4_5_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                moe_num_shared_experts=int(f.get("expert_shared_count", 0)),
                moe_layer_start_index=int(f.get("leading_dense_block_count", 0)),
                moe_layer_interval=int(f.get("interleave_moe_layer_step", 1)),
                use_bias=_has(f, "blk.0.attn_q.bias"))


def _qwen35moe(f: GGUFFile) -> dict:
    # Qwen3-Next's layout with separate q/k/v, z, a, b projections; text positions make its
    # interleaved multimodal RoPE the plain one (transformers' default sections are llama.cpp's).
    sections = [int(n) for n in f.require("rope.dimension_sections")]
    return dict(_qwen3next(f), model_type="qwen3_5_moe_text", mrope_section=sections[:3])


def _qwen3next(f: GGUFFile) -> dict:
    # Gated-delta linear attention in the layers `attention.recurrent_layers` marks, full attention
    # (with an output gate in q_proj) in the others.
    head_dim = int(f.require("attention.key_length"))
    value_heads = int(f.require("ssm.time_step_rank"))
    recurrent = f.require("attention.recurrent_layers")
    return dict(_experts(f, "num_experts"), model_type="qwen3_next",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                shared_expert_intermediate_size=int(f.get("expert_shared_feed_forward_length", 0)),
                layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
                linear_conv_kernel_dim=int(f.require("ssm.conv_kernel")),
                linear_key_head_dim=int(f.require("ssm.state_size")),
                linear_num_key_heads=int(f.require("ssm.group_count")),
                linear_num_value_heads=value_heads,
                linear_value_head_dim=int(f.require("ssm.inner_size")) // value_heads,
                partial_rotary_factor=int(f.require("rope.dimension_count")) / head_dim)


def _minimax_m2(f: GGUFFile) -> dict:
    head_dim = int(f.require("attention.key_length"))
    return dict(_experts(f, "num_local_experts"), model_type="minimax_m2",
                intermediate_size=int(f.require("expert_feed_forward_length")),
                partial_rotary_factor=int(f.get("rope.dimension_count", head_dim)) / head_dim)


def _attention_layers(f: GGUFFile, other: str) -> list[str]:
    """layer_types of a hybrid whose non-attention layers have no kv heads in `attention.head_count_kv`."""
    return ["full_attention" if heads else other for heads in f.require("attention.head_count_kv")]


def _lfm2moe(f: GGUFFile) -> dict:
    # Short-convolution layers where `attention.head_count_kv` is 0, attention in the others.
    return dict(_experts(f, "num_experts"), model_type="lfm2_moe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                num_dense_layers=int(f.get("leading_dense_block_count", 0)),
                layer_types=_attention_layers(f, "conv"), conv_L_cache=int(f.require("shortconv.l_cache")),
                norm_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-5)))


def _granitehybrid(f: GGUFFile) -> dict:
    # Granite 4 (-H): Mamba-2 layers where `attention.head_count_kv` is 0; llama.cpp applies RoPE
    # unless `rope.scaling.finetuned` is false, transformers when position_embedding_type is "rope".
    inner, heads = int(f.require("ssm.inner_size")), int(f.require("ssm.time_step_rank"))
    return dict(_granitemoe(f), model_type="granitemoehybrid", layer_types=_attention_layers(f, "linear_attention"),
                mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_d_state=int(f.require("ssm.state_size")),
                mamba_n_groups=int(f.require("ssm.group_count")), mamba_d_conv=int(f.require("ssm.conv_kernel")),
                mamba_expand=inner // int(f.require("embedding_length")),
                position_embedding_type="rope" if f.get("rope.scaling.finetuned", True) else None)


def _nemotron_h_moe(f: GGUFFile) -> dict:
    # Nemotron-H MoE (Nemotron 3): per layer, attention where it has kv heads, MoE where it has a
    # feed-forward length, Mamba-2 elsewhere; experts are squared-ReLU up/down (no gate).
    kv_heads, feed_forward = f.require("attention.head_count_kv"), f.require("feed_forward_length")
    inner, heads = int(f.require("ssm.inner_size")), int(f.require("ssm.time_step_rank"))
    return dict(_experts(f, "n_routed_experts"), model_type="nemotron_h",
                layers_block_type=["full_attention" if kv else "moe" if ff else "linear_attention"
                                   for kv, ff in zip(kv_heads, feed_forward)],
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                moe_shared_expert_intermediate_size=int(f.get("expert_shared_feed_forward_length", 0)),
                n_shared_experts=int(f.get("expert_shared_count", 0)),
                mamba_num_heads=heads, mamba_head_dim=inner // heads, ssm_state_size=int(f.require("ssm.state_size")),
                n_groups=int(f.require("ssm.group_count")), conv_kernel=int(f.require("ssm.conv_kernel")),
                expand=inner // int(f.require("embedding_length")),
                layer_norm_epsilon=float(f.get("attention.layer_norm_epsilon", 1e-5)))


def _hunyuan_moe(f: GGUFFile) -> dict:
    # Hunyuan-A13B: its experts and its shared MLP are both `intermediate_size` wide.
    return dict(_experts(f, "num_experts", "moe_topk"), model_type="hunyuan_v1_moe",
                intermediate_size=int(f.require("expert_feed_forward_length")),
                attention_bias=_has(f, "blk.0.attn_q.bias"))


def _afmoe(f: GGUFFile) -> dict:
    # Arcee Trinity: sliding-window attention with every 4th layer global (llama.cpp's pattern when
    # the file gives none), gated attention, and MuP embedding scaling, which llama.cpp always applies.
    return dict(_experts(f, "num_experts"), model_type="afmoe",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                num_shared_experts=int(f.get("expert_shared_count", 0)),
                num_dense_layers=int(f.get("leading_dense_block_count", 0)),
                sliding_window=int(f.get("attention.sliding_window", 1024)), global_attn_every_n_layers=4,
                mup_enabled=True)


def _exaone_moe(f: GGUFFile) -> dict:
    # K-EXAONE: DeepSeek-V3-style routing, sliding-window layers where the file's pattern says so
    # (RoPE only there when there is a window), leading dense layers, MTP layers beyond block_count's text.
    nextn = int(f.get("nextn_predict_layers", 0))
    layers = int(f.require("block_count")) - nextn
    dense = int(f.get("leading_dense_block_count", 0))
    pattern = f.get("attention.sliding_window_pattern")
    return dict(_experts(f, "num_experts"), model_type="exaone_moe", num_hidden_layers=layers,
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                num_shared_experts=int(f.get("expert_shared_count", 0)), first_k_dense_replace=dense,
                mlp_layer_types=["dense" if layer < dense else "sparse" for layer in range(layers)],
                sliding_window=int(f.get("attention.sliding_window", 4096)) if pattern else None,
                layer_types=["sliding_attention" if sliding else "full_attention" for sliding in (pattern or [False] * layers)][:layers])


def _moe_layers(f: GGUFFile) -> set[int]:
    """Layers with a router or stacked expert tensors (a slice file has only the latter, of its layers)."""
    return {int(name.split(".")[1]) for name in f.tensors
            if name.startswith("blk.") and (".ffn_gate_inp." in name or "_exps." in name)}


def _mellum(f: GGUFFile) -> dict:
    # Sliding-window layers where the file's pattern says so, each layer type with its own RoPE base.
    layers = int(f.require("block_count"))
    pattern = f.get("attention.sliding_window_pattern") or [False] * layers
    base = float(f.get("rope.freq_base", 10000.0))
    moe = _moe_layers(f)
    return dict(_experts(f, "num_local_experts"), model_type="mellum",
                moe_intermediate_size=int(f.require("expert_feed_forward_length")),
                layer_types=["sliding_attention" if sliding else "full_attention" for sliding in pattern],
                mlp_layer_types=["sparse" if layer in moe else "dense" for layer in range(layers)],
                sliding_window=int(f.get("attention.sliding_window", 1024)),
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": base},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": float(f.get("rope.freq_base_swa", base))}})


def _hy_v3(f: GGUFFile) -> dict:
    layers, moe = int(f.require("block_count")), _moe_layers(f)
    expert_ff = int(f.require("expert_feed_forward_length"))
    return dict(_experts(f, "num_experts"), model_type="hy_v3", moe_intermediate_size=expert_ff,
                num_shared_experts=int(f.get("expert_shared_feed_forward_length", 0)) // expert_ff,
                mlp_layer_types=["sparse" if layer in moe else "dense" for layer in range(layers)])


def _laguna(f: GGUFFile) -> dict:
    # Laguna: with a sliding window, layer 0 of every 4 global and the rest sliding (llama.cpp's
    # pattern; GGUF records none), each layer type with its own RoPE base and rotary width; gated
    # attention; per-layer head counts; leading dense layers.
    layers, head_dim = int(f.require("block_count")), int(f.require("attention.key_length"))
    window = int(f.get("attention.sliding_window", 0))
    heads = f.require("attention.head_count")
    dense = int(f.get("leading_dense_block_count", 0))
    base = float(f.get("rope.freq_base", 10000.0))
    rotary = int(f.get("rope.dimension_count", head_dim))
    return dict(_experts(f, "num_experts"), model_type="laguna",
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


def _cohere2moe(f: GGUFFile) -> dict:
    # Cohere2-MoE: parallel attention and MoE on one LayerNorm; sliding-window layers (with RoPE)
    # where the file's pattern says so, global ones without; the shared expert averaged with the
    # routed ones (llama.cpp hard-codes the 0.5).
    layers = int(f.require("block_count"))
    pattern = f.get("attention.sliding_window_pattern") or [False] * layers
    dense = int(f.get("leading_dense_block_count", 0))
    return dict(_experts(f, "num_experts"), model_type="cohere2_moe",
                intermediate_size=int(f.require("expert_feed_forward_length")),  # experts; shared: x num_shared
                num_shared_experts=int(f.get("expert_shared_count", 0)), shared_expert_combination_strategy="average",
                layer_norm_eps=float(f.get("attention.layer_norm_epsilon", 1e-5)),
                # LayerNorm unless the file gives an RMS epsilon (llama.cpp's rule; transformers': rms_norm_eps None)
                rms_norm_eps=float(rms) if (rms := f.get("attention.layer_norm_rms_epsilon")) is not None else None,
                logit_scale=float(f.get("logit_scale", 1.0)), sliding_window=int(f.get("attention.sliding_window", 4096)),
                layer_types=["sliding_attention" if sliding else "full_attention" for sliding in pattern],
                mlp_layer_types=["dense" if layer < dense else "sparse" for layer in range(layers)])


def _period(layers: list[int], count: int) -> tuple[int, int]:
    """(period, offset) of evenly spaced layer indices (Jamba's attention and expert layers)."""
    if not layers:
        return count + 1, count  # none
    return (layers[1] - layers[0] if len(layers) > 1 else count), layers[0]


def _jamba(f: GGUFFile) -> dict:
    # Mamba layers where `attention.head_count_kv` is 0; experts in the layers that have a router
    # or stacked expert tensors (dense MLPs in the others); GGUF records neither period.
    count = int(f.require("block_count"))
    attention = [layer for layer, heads in enumerate(f.require("attention.head_count_kv")) if heads]
    moe = sorted(_moe_layers(f))
    (attn_period, attn_offset), (expert_period, expert_offset) = _period(attention, count), _period(moe, count)
    inner = int(f.require("ssm.inner_size"))
    return dict(_experts(f, "num_experts"), model_type="jamba",
                attn_layer_period=attn_period, attn_layer_offset=attn_offset,
                expert_layer_period=expert_period, expert_layer_offset=expert_offset,
                mamba_d_state=int(f.require("ssm.state_size")), mamba_d_conv=int(f.require("ssm.conv_kernel")),
                mamba_expand=inner // int(f.require("embedding_length")), mamba_dt_rank=int(f.require("ssm.time_step_rank")),
                use_mamba_kernels=False)


ARCHITECTURES: dict[str, Callable[[GGUFFile], dict]] = {
    "qwen2moe": _qwen2moe,
    "qwen3moe": _qwen3moe,
    "olmoe": _olmoe,
    "llama": _llama,  # Mixtral is llama with experts in GGUF
    "deepseek2": _deepseek2,
    "glm4moe": _glm4moe,
    "gpt-oss": _gpt_oss,
    "granitemoe": _granitemoe,
    "dots1": _dots1,
    "ernie4_5-moe": _ernie4_5_moe,
    "qwen3next": _qwen3next,
    "qwen35moe": _qwen35moe,
    "minimax-m2": _minimax_m2,
    "lfm2moe": _lfm2moe,
    "granitehybrid": _granitehybrid,
    "nemotron_h_moe": _nemotron_h_moe,
    "hunyuan-moe": _hunyuan_moe,
    "jamba": _jamba,
    "afmoe": _afmoe,
    "exaone-moe": _exaone_moe,
    "mellum": _mellum,
    "hy_v3": _hy_v3,
    "laguna": _laguna,
    "cohere2moe": _cohere2moe,
}


def config_from_gguf(f: GGUFFile) -> PretrainedConfig:
    require_supported(f)
    values = {**_common(f), **ARCHITECTURES[f.arch](f)}
    model_type = values.pop("model_type")
    values.update(routing_from_gguf(f, model_type))
    rope = values.pop("rope_parameters")
    for key in ("partial_rotary_factor", "mrope_section"):
        if key in values:
            rope[key] = values.pop(key)
    scaling = f.get("rope.scaling.type")
    rope_extra = values.pop("rope_extra", {})
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(f.get("rope.scaling.factor", 1.0)),
                    original_max_position_embeddings=int(f.get("rope.scaling.original_context_length", 4096)))
        for key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if (value := f.get(f"rope.scaling.{gguf_key}")) is not None:
                rope[key] = float(value)
        rope.update(rope_extra)
    try:
        return AutoConfig.for_model(model_type, rope_parameters=rope, **values)
    except Exception as error:
        raise ModelError(f"{f.path}: cannot build a {model_type} config from the GGUF metadata: {error}") from None
