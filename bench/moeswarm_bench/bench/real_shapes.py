"""The whole-model shapes `moeswarm bench real` builds: real models' dimensions, random weights.

Each shape is a full decoder (every layer of OLMoE-1B-7B; 8 of Qwen3-30B-A3B's 48 layers and 8 of
GLM-4.7-Flash's 47, so that the file stays ~3 GB at Q4_K_M and a run within minutes) with the real
hidden size, attention heads, experts, top-k and vocabulary. GLM-4.7-Flash stands for the DeepSeek
family (multi-head latent attention, a shared expert, sigmoid routing with a score bias, a dense
first layer): llama.cpp reads it as `deepseek2`. `hf_config` is what the model's config.json says and
`hf_tensors` lists its checkpoint tensors as the Hub's files name them (one tensor per expert
and projection: what llama.cpp's converter reads).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention and the DeepSeek family's MLP layout (config.json's names in comments)."""

    q_rank: int  # q_lora_rank
    kv_rank: int  # kv_lora_rank
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    value: int  # v_head_dim
    shared: int  # n_shared_experts, each of the routed experts' size
    dense_layers: int  # first_k_dense_replace: the first layers have a dense MLP
    dense_inner: int  # intermediate_size of those


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
    latent: Latent | None = None  # None: q/k/v/o attention, every layer's MLP routed

    def hf_config(self) -> dict:
        """config.json of the model (random weights: the values that set the shape and the maths)."""
        config = {"architectures": [self.architecture], "model_type": self.model_type, "num_hidden_layers": self.layers,
                  "hidden_size": self.hidden, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                  "head_dim": self.head_dim, "num_experts": self.experts, "num_experts_per_tok": self.top_k,
                  "vocab_size": self.vocab, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16"}
        if self.latent is not None:
            a = self.latent
            del config["num_experts"]
            config.update({"n_routed_experts": self.experts, "moe_intermediate_size": self.inner, "q_lora_rank": a.q_rank,
                           "kv_lora_rank": a.kv_rank, "qk_nope_head_dim": a.nope, "qk_rope_head_dim": a.rope,
                           "v_head_dim": a.value, "head_dim": a.rope, "n_shared_experts": a.shared,
                           "first_k_dense_replace": a.dense_layers, "intermediate_size": a.dense_inner})
        config.update(dict(self.extra))
        return config

    def hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """{checkpoint tensor name: shape}, in file order: embeddings, layer by layer, final norm, head."""
        if self.latent is not None:
            return _latent_tensors(self, self.latent)
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

    def describe(self) -> str:
        """One line for a report: the model, the part of its depth built, its dimensions."""
        depth = f" ({self.note})" if self.note else ""
        a = self.latent
        if a is None:
            kv = f" / {self.kv_heads} KV heads" if self.kv_heads != self.heads else ""
            attention = f"{self.heads} heads{kv} of {self.head_dim}"
            experts = f"{self.experts} experts of {self.inner}"
        else:
            attention = (f"{self.heads} heads of multi-head latent attention (q rank {a.q_rank}, kv rank {a.kv_rank}, "
                         f"nope {a.nope}, rope {a.rope}, value {a.value})")
            experts = f"{self.experts} experts of {self.inner} and {a.shared} shared ({a.dense_layers} dense first)"
        return (f"{self.model}'s shape{depth}: {self.layers} layers, hidden {self.hidden}, {attention}, {experts}, "
                f"top-{self.top_k}, vocabulary {self.vocab}")

    def key(self) -> str:
        """The cache file's name stem: every dimension that changes the file."""
        a = self.latent
        attention = (f"h{self.heads}x{self.head_dim}kv{self.kv_heads}" if a is None else
                     f"h{self.heads}q{a.q_rank}kv{a.kv_rank}x{a.nope}+{a.rope}v{a.value}-s{a.shared}dense{a.dense_layers}")
        return f"{self.model_type}-L{self.layers}-d{self.hidden}-{attention}-e{self.experts}x{self.inner}k{self.top_k}-v{self.vocab}"


def _latent_tensors(shape: ModelShape, a: Latent) -> dict[str, tuple[int, ...]]:
    """hf_tensors of a latent-attention shape, as DeepSeek-V3's and GLM-4.7-Flash's checkpoints name them."""
    d, heads, shared_rows = shape.hidden, shape.heads, a.shared * shape.inner
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, d)}
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}"
        tensors.update({
            f"{prefix}.input_layernorm.weight": (d,),
            f"{prefix}.self_attn.q_a_proj.weight": (a.q_rank, d),
            f"{prefix}.self_attn.q_a_layernorm.weight": (a.q_rank,),
            f"{prefix}.self_attn.q_b_proj.weight": (heads * (a.nope + a.rope), a.q_rank),
            f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": (a.kv_rank + a.rope, d),
            f"{prefix}.self_attn.kv_a_layernorm.weight": (a.kv_rank,),
            f"{prefix}.self_attn.kv_b_proj.weight": (heads * (a.nope + a.value), a.kv_rank),
            f"{prefix}.self_attn.o_proj.weight": (d, heads * a.value),
            f"{prefix}.post_attention_layernorm.weight": (d,),
        })
        if layer < a.dense_layers:
            tensors.update({f"{prefix}.mlp.gate_proj.weight": (a.dense_inner, d),
                            f"{prefix}.mlp.up_proj.weight": (a.dense_inner, d),
                            f"{prefix}.mlp.down_proj.weight": (d, a.dense_inner)})
            continue
        tensors[f"{prefix}.mlp.gate.weight"] = (shape.experts, d)  # the router
        tensors[f"{prefix}.mlp.gate.e_score_correction_bias"] = (shape.experts,)  # a vector: ones (no expert favoured)
        for expert in range(shape.experts):
            tensors.update({
                f"{prefix}.mlp.experts.{expert}.gate_proj.weight": (shape.inner, d),
                f"{prefix}.mlp.experts.{expert}.up_proj.weight": (shape.inner, d),
                f"{prefix}.mlp.experts.{expert}.down_proj.weight": (d, shape.inner),
            })
        tensors.update({f"{prefix}.mlp.shared_experts.gate_proj.weight": (shared_rows, d),
                        f"{prefix}.mlp.shared_experts.up_proj.weight": (shared_rows, d),
                        f"{prefix}.mlp.shared_experts.down_proj.weight": (d, shared_rows)})
    tensors["model.norm.weight"] = (d,)
    tensors["lm_head.weight"] = (shape.vocab, d)
    return tensors


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
    "glm47flash": ModelShape("glm47flash", "GLM-4.7-Flash", "glm4_moe_lite", "Glm4MoeLiteForCausalLM", layers=8,
                             hidden=2048, heads=20, kv_heads=20, head_dim=64, experts=64, inner=1536, top_k=4,
                             vocab=154880, qk_norm_per_head=False,
                             latent=Latent(q_rank=768, kv_rank=512, nope=192, rope=64, value=256, shared=1,
                                           dense_layers=1, dense_inner=10240),
                             extra=(("rms_norm_eps", 1e-5), ("rope_theta", 10000.0), ("rope_interleave", True),
                                    ("norm_topk_prob", True), ("routed_scaling_factor", 1.8), ("n_group", 1),
                                    ("topk_group", 1), ("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")),
                             note="8 of its 47 layers: the dense first and 7 MoE layers"),
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
