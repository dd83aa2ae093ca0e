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
from moeswarm.gguf import gguf_config_families as families
from moeswarm.gguf import gguf_config_hybrids as hybrids
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_routing import routing_from_gguf
from moeswarm.gguf.gguf_support import require_supported


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


ARCHITECTURES: dict[str, Callable[[GGUFFile], dict]] = {
    "qwen2moe": families.qwen2moe,
    "qwen3moe": families.qwen3moe,
    "olmoe": families.olmoe,
    "llama": families.llama,  # Mixtral is llama with experts in GGUF
    "deepseek2": families.deepseek2,
    "glm4moe": families.glm4moe,
    "gpt-oss": families.gpt_oss,
    "granitemoe": families.granitemoe,
    "dots1": families.dots1,
    "ernie4_5-moe": families.ernie4_5_moe,
    "qwen3next": hybrids.qwen3next,
    "qwen35moe": hybrids.qwen35moe,
    "minimax-m2": families.minimax_m2,
    "lfm2moe": hybrids.lfm2moe,
    "granitehybrid": hybrids.granitehybrid,
    "nemotron_h_moe": hybrids.nemotron_h_moe,
    "hunyuan-moe": families.hunyuan_moe,
    "jamba": hybrids.jamba,
    "afmoe": families.afmoe,
    "exaone-moe": families.exaone_moe,
    "mellum": families.mellum,
    "hy_v3": families.hy_v3,
    "laguna": families.laguna,
    "cohere2moe": families.cohere2moe,
    "granite_swa": families.granite_swa,
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
