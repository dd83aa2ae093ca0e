"""The whole-model shapes `moeswarm bench real` builds: real models' dimensions, random weights.

Each shape is a full decoder (every layer of OLMoE-1B-7B; 8 of Qwen3-30B-A3B's 48 layers, so that
the file stays ~3 GB at Q4_K_M and a run within minutes) with the real hidden size, attention
heads, experts, top-k and vocabulary. `hf_config` is what the model's config.json says and
`hf_tensors` lists its checkpoint tensors as the Hub's files name them (one tensor per expert
and projection: what llama.cpp's converter reads).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    model: str  # the real model whose dimensions these are
    model_type: str  # transformers' model_type
    architecture: str  # config.json's architectures[0]: the converter picks its model class by it
    layers: int
    hidden: int  # d
    heads: int
    kv_heads: int
    head_dim: int
    experts: int  # E routed experts per layer
    inner: int  # I, each expert's intermediate size
    top_k: int
    vocab: int  # V
    # OLMoE normalizes q and k over all heads at once (q_norm [heads x head_dim]); Qwen3 per head ([head_dim])
    qk_norm_per_head: bool
    extra: tuple[tuple[str, object], ...] = ()  # other config.json keys, as the real model's
    note: str = ""

    def hf_config(self) -> dict:
        """config.json of the model (random weights: the values that set the shape and the maths)."""
        config = {"architectures": [self.architecture], "model_type": self.model_type, "num_hidden_layers": self.layers,
                  "hidden_size": self.hidden, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                  "head_dim": self.head_dim, "num_experts": self.experts, "num_experts_per_tok": self.top_k,
                  "vocab_size": self.vocab, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16"}
        config.update(dict(self.extra))
        return config

    def hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """{checkpoint tensor name: shape}, in file order: embeddings, layer by layer, final norm, head."""
        d, q_rows, kv_rows = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        q_norm, k_norm = (self.head_dim, self.head_dim) if self.qk_norm_per_head else (q_rows, kv_rows)
        tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, d)}
        for layer in range(self.layers):
            prefix = f"model.layers.{layer}"
            tensors.update({
                f"{prefix}.input_layernorm.weight": (d,),
                f"{prefix}.self_attn.q_proj.weight": (q_rows, d),
                f"{prefix}.self_attn.k_proj.weight": (kv_rows, d),
                f"{prefix}.self_attn.v_proj.weight": (kv_rows, d),
                f"{prefix}.self_attn.o_proj.weight": (d, q_rows),
                f"{prefix}.self_attn.q_norm.weight": (q_norm,),
                f"{prefix}.self_attn.k_norm.weight": (k_norm,),
                f"{prefix}.post_attention_layernorm.weight": (d,),
                f"{prefix}.mlp.gate.weight": (self.experts, d),  # the router
            })
            for expert in range(self.experts):
                tensors.update({
                    f"{prefix}.mlp.experts.{expert}.gate_proj.weight": (self.inner, d),
                    f"{prefix}.mlp.experts.{expert}.up_proj.weight": (self.inner, d),
                    f"{prefix}.mlp.experts.{expert}.down_proj.weight": (d, self.inner),
                })
        tensors["model.norm.weight"] = (d,)
        tensors["lm_head.weight"] = (self.vocab, d)
        return tensors

    def parameters(self) -> int:
        total = 0
        for shape in self.hf_tensors().values():
            count = 1
            for size in shape:
                count *= size
            total += count
        return total

    def key(self) -> str:
        """The cache file's name stem: every dimension that changes the file."""
        return (f"{self.model_type}-L{self.layers}-d{self.hidden}-h{self.heads}x{self.head_dim}kv{self.kv_heads}"
                f"-e{self.experts}x{self.inner}k{self.top_k}-v{self.vocab}")


_OLMOE = dict(model_type="olmoe", architecture="OlmoeForCausalLM", qk_norm_per_head=False,
              extra=(("intermediate_size", 1024), ("rms_norm_eps", 1e-5), ("rope_theta", 10000.0),
                     ("norm_topk_prob", False)))

SHAPES: dict[str, ModelShape] = {
    "olmoe": ModelShape("olmoe", "OLMoE-1B-7B", layers=16, hidden=2048, heads=16, kv_heads=16, head_dim=128,
                        experts=64, inner=1024, top_k=8, vocab=50304, **_OLMOE),
    "qwen3": ModelShape("qwen3", "Qwen3-30B-A3B", "qwen3_moe", "Qwen3MoeForCausalLM", layers=8, hidden=2048, heads=32,
                        kv_heads=4, head_dim=128, experts=128, inner=768, top_k=8, vocab=151936, qk_norm_per_head=True,
                        extra=(("moe_intermediate_size", 768), ("intermediate_size", 6144), ("rms_norm_eps", 1e-6),
                               ("rope_theta", 1e6), ("norm_topk_prob", True), ("decoder_sparse_step", 1),
                               ("mlp_only_layers", [])),
                        note="8 of its 48 layers"),
}

# --quick: an OLMoE-like model whose rows still fit K-quants (multiples of 256), for the smoke test.
QUICK_SHAPE = ModelShape("tiny", "tiny OLMoE-like (smoke test)", layers=2, hidden=256, heads=4, kv_heads=4, head_dim=64,
                         experts=8, inner=256, top_k=2, vocab=512,
                         **{**_OLMOE, "extra": (("intermediate_size", 256), ("rms_norm_eps", 1e-5),
                                                ("rope_theta", 10000.0), ("norm_topk_prob", False))})

DEFAULT_SHAPES = ("olmoe", "qwen3")
QUANT_TYPE = "Q4_K_M"
PROMPT_TOKENS = 64
DECODE_TOKENS = 32
WEIGHT_STD = 0.02  # random N(0, 0.02) matrices: activations stay finite through every layer
