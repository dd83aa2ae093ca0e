"""Tiny random MoE models of many families, for tests and trials (`moeswarm make-model`).

Adding a family is adding a line: the keys beyond the common ones are each family's names for
its number of experts, top-k and expert sizes. Every model gets a byte-level tokenizer so text
goes in and out without a hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, vocab_size=260, max_position_embeddings=256, tie_word_embeddings=False)
_DEEPSEEK_LIKE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                      n_group=2, topk_group=1, n_shared_experts=1)
_GROUPED = dict(n_group=2, topk_group=1)  # group-limited routing: 2 groups of 4 experts, the best group kept
_MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
_MLA_KV = {key: value for key, value in _MLA.items() if key != "q_lora_rank"}  # latent kv, full-rank q
_INDEXER = dict(index_topk=4, index_head_dim=8, index_n_heads=2)  # sparse-attention indexers (DSA and kin)
_HYBRID = ["linear_attention", "full_attention", "linear_attention"]  # one attention layer, so the cache has a length
_GATED_DELTA = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)

# Proved by tests/test_families.py (worker processes over TCP): a representative set, kept small for CI.
FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(_DEEPSEEK_LIKE, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "glm4_moe": dict(_DEEPSEEK_LIKE),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16, moe_layer_start_index=1),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "dots1": dict(_DEEPSEEK_LIKE),
    "deepseek_v2": dict(_DEEPSEEK_LIKE, **_MLA, n_group=None, topk_group=None),  # greedy top-k, no groups
    "deepseek_v4": dict(_DEEPSEEK_LIKE, q_lora_rank=16, o_lora_rank=16, o_groups=2, qk_rope_head_dim=8, **_INDEXER, mlp_layer_types=["hash_moe", "moe", "moe"]),
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32, **_GATED_DELTA, layer_types=_HYBRID),
    "jamba": dict(num_experts=8, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=4, use_mamba_kernels=False, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
    "zaya": dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=16, router_hidden_size=32),  # top-1 only
}

# Proved by scripts/survey_families.py (in-process workers over TCP, the same check): every other
# family that passes, kept out of the CI runner to keep it fast. `make_tiny_model` takes them too.
EXTRA_FAMILIES: dict[str, dict] = {
    "afmoe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1, num_dense_layers=1),
    "aria_text": dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1),
    "axk1": dict(_DEEPSEEK_LIKE, **_MLA),
    "axk2": dict(_DEEPSEEK_LIKE, **_MLA, **_INDEXER, n_group=None, topk_group=None, gated_norm_rank=4),
    "bailing_hybrid": dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1, num_expert_group=2, topk_group=1, first_k_dense_replace=1, **_MLA_KV, linear_head_dim=8, linear_num_heads=4, pad_token_id=258, layer_types=_HYBRID),
    "beam": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, **_GROUPED, mlp_layer_types=["dense", "sparse", "sparse"]),
    "cohere2_moe": dict(num_experts=8, num_experts_per_tok=2, num_shared_experts=1),
    "deepseek_v32": dict(_DEEPSEEK_LIKE, **_MLA, **_INDEXER),
    "dots3_note_text": dict(_DEEPSEEK_LIKE, **_MLA, **_INDEXER, shared_experts_intermediate_size=32, pad_token_id=258),
    "exaone_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1, **_GROUPED),
    "flex_olmo": dict(num_experts=8, num_experts_per_tok=2, pad_token_id=258),
    "flint": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32, mlp_only_layers=[0]),
    "glm4_moe_lite": dict(_DEEPSEEK_LIKE, **_MLA, first_k_dense_replace=None),
    "glm_moe_dsa": dict(_DEEPSEEK_LIKE, **_MLA, **_INDEXER),
    "granitemoe_swa": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=32),
    "granitemoehybrid": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, mamba_n_groups=1, layer_types=_HYBRID),
    "granitemoeshared": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=32),
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2),
    "hy_v3": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1),
    "hy_v4": dict(_DEEPSEEK_LIKE, **_MLA, **_INDEXER, first_k_dense_replace=None, pad_token_id=258),
    "inkling_text": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8),
    "inkling2_text": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8),
    "kimi_linear": dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1, num_expert_group=2, topk_group=1, **_MLA_KV, linear_head_dim=8, linear_num_heads=4, pad_token_id=258, layer_types=_HYBRID),
    "kolibri1": dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    "laguna": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    "lfm2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    "mellum": dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
    "mimo_v2_flash": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, **_GROUPED, v_head_dim=8),
    "minimax": dict(num_local_experts=8, num_experts_per_tok=2),
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2),
    "minimax_m3_vl_text": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=32, dense_intermediate_size=64, index_head_dim=8, index_n_heads=2, index_topk_blocks=2),
    "nemotron_h": dict(_DEEPSEEK_LIKE, moe_shared_expert_intermediate_size=32, first_k_dense_replace=None, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, use_mamba_kernels=False, layers_block_type=["linear_attention", "moe", "full_attention"]),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen3_5_moe_text": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32, **_GATED_DELTA, layer_types=_HYBRID),
    "qwen4_exp_text": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32, **_GATED_DELTA, layer_types=["linear_attention", "indexed_attention", "linear_attention"], indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4),
    "solar_open": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, **_GROUPED),
}


def tiny_config(family: str, **overrides):
    keys = FAMILIES.get(family, EXTRA_FAMILIES.get(family))
    if keys is None:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(sorted({**FAMILIES, **EXTRA_FAMILIES}))}")
    return AutoConfig.for_model(family, **{**COMMON, **keys, **overrides})


def make_tiny_model(family: str, out: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a random model of `family` to `out` (config, safetensors, byte tokenizer)."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init leaves some tensors tiny or zero (biases, norms); spread them so routing and
    # logits depend on every weight, which makes remote == local a real test.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    out = Path(out)
    model.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """UTF-8 bytes as tokens 0-255, plus <s>=256, </s>=257, <pad>=258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {BYTE_TO_UNICODE[b]: b for b in range(256)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, used by ByteLevel."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()
