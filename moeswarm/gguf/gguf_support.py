"""Which GGUF architectures moeswarm runs, and why not the others: the support table.

SUPPORTED names, for each GGUF architecture (`general.architecture`) that loads, slices and
serves, the transformers families it becomes. UNSUPPORTED names the MoE architectures llama.cpp's
converter writes and transformers implements through its experts interface that do not load yet,
each with the reason. docs/models.md is the same list for people; tests check the two agree with
the config, routing and names tables.
"""

from __future__ import annotations

from moeswarm.errors import ModelError
from moeswarm.gguf.gguf_file import GGUFFile

DOCS = "docs/models.md"

SUPPORTED: dict[str, str] = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "llama": "mixtral",
    "deepseek2": "deepseek_v2, deepseek_v3; glm4_moe_lite runs as deepseek_v3",
    "glm4moe": "glm4_moe",
    "gpt-oss": "gpt_oss",
    "granitemoe": "granitemoe, granitemoeshared",
    "dots1": "dots1",
    "ernie4_5-moe": "ernie4_5_moe",
    "qwen3next": "qwen3_next",
    "qwen35moe": "qwen3_5_moe (text model: qwen3_5_moe_text)",
    "minimax-m2": "minimax_m2",
    "lfm2moe": "lfm2_moe",
    "granitehybrid": "granitemoehybrid",
    "nemotron_h_moe": "nemotron_h (MoE)",
    "hunyuan-moe": "hunyuan_v1_moe",
    "jamba": "jamba",
    "afmoe": "afmoe",
    "exaone-moe": "exaone_moe",
    "mellum": "mellum",
    "hy_v3": "hy_v3",
    "laguna": "laguna",
    "cohere2moe": "cohere2_moe",
    "granite_swa": "granitemoe_swa",
}

_NO_NAMES = "the gguf-py moeswarm reads with (0.19) has no tensor-name map for this architecture"
UNSUPPORTED: dict[str, str] = {
    "hy_v4": _NO_NAMES,
    "deepseek32": _NO_NAMES,
    "deepseek4": _NO_NAMES,
    "dots3note": _NO_NAMES,
    "minimax-m3": _NO_NAMES,
    "qwen4exp": _NO_NAMES,
    "minimax-01": _NO_NAMES + "; its lightning attention is not mapped",
    "phimoe": "llama.cpp and transformers disagree on it (a trial mapping equal to the HF model: llama.cpp's logits at cosine 0.88)",
    "kimi-linear": "not mapped yet: Kimi Delta Attention layers",
    "mimo2": "not mapped yet: MiMo-V2's hybrid sliding-window layout",
    "glm-dsa": "not mapped yet: the DeepSeek sparse-attention indexer",
    "gemma4": "not mapped yet: Gemma 4's MoE block beside its dense MLP",
    "qwen3vlmoe": "a multimodal model: transformers 5.23 has no causal-LM class for its text model",
    "glm5-next": "a multimodal model: transformers 5.23 has no causal-LM class for its text model",
}


def support_status(arch: str) -> tuple[bool, str]:
    """(supported, one line): the families a supported architecture becomes, or why it is not."""
    if arch in SUPPORTED:
        return True, f"supported (transformers {SUPPORTED[arch]}): loads, slices, serves"
    if arch in UNSUPPORTED:
        return False, f"not supported: {UNSUPPORTED[arch]}"
    return False, "not supported: not a MoE architecture moeswarm knows"


def require_supported(f: GGUFFile) -> None:
    """A one-line ModelError for a file whose architecture moeswarm does not run."""
    supported, status = support_status(f.arch)
    if not supported:
        raise ModelError(f"{f.path}: unsupported GGUF architecture {f.arch!r} ({status.removeprefix('not supported: ')}); "
                         f"supported: {', '.join(sorted(SUPPORTED))}; see {DOCS}")
