"""Tiny random MoE models of many families, for tests and trials (`moeswarm make-model`).

Adding a family is adding a line: the keys beyond the common ones are each family's names for
its number of experts, top-k and expert sizes. Every model gets a byte-level tokenizer so text
goes in and out without a hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, vocab_size=260, max_position_embeddings=256, tie_word_embeddings=False)
_DEEPSEEK_LIKE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                      n_group=2, topk_group=1, n_shared_experts=1)

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
}


def tiny_config(family: str, **overrides):
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(sorted(FAMILIES))}")
    return AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})


def make_tiny_model(family: str, out: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a random model of `family` to `out` (config, safetensors, byte tokenizer)."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
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

    vocab = {_BYTE_TO_UNICODE[b]: b for b in range(256)}
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


_BYTE_TO_UNICODE = _bytes_to_unicode()
