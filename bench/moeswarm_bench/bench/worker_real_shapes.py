"""The MoE layer shapes `moeswarm bench worker` measures: real models' expert dimensions.

Each shape is one routed-expert layer of a real model (hidden size d, E experts of inner size I,
top-k), written as a one-layer qwen3moe GGUF: llama.cpp and moeswarm both run that architecture,
and its experts are the plain SwiGLU experts (gate, up [E, I, d], down [E, d, I]) all three models
use. What the carrier changes is outside the experts: attention is small (4 heads), the vocabulary
is 512 tokens. gpt-oss's own experts also have biases and a clamped SwiGLU, a few percent of their
work; DeepSeek-V3 keeps 32 of its 256 experts per layer (a quarter is then 8 experts, its top-k),
so that the file stays ~0.8 GB at Q4_K_M and the run within a few minutes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerShape:
    name: str
    model: str  # the real model whose expert dimensions these are
    hidden: int  # d
    experts: int  # E routed experts in the layer
    inner: int  # I, each expert's intermediate size
    top_k: int
    note: str = ""

    def weights_per_expert(self) -> int:
        return 3 * self.inner * self.hidden  # gate, up [I, d] and down [d, I]


SHAPES: dict[str, LayerShape] = {
    "qwen3": LayerShape("qwen3", "Qwen3-30B-A3B", 2048, 128, 768, 8),
    "gpt-oss": LayerShape("gpt-oss", "gpt-oss-20b", 2880, 32, 2880, 4,
                          note="rows of 2880 are not a multiple of 256: llama.cpp stores K-quant requests as Q5_0/Q8_0"),
    "deepseek-v3": LayerShape("deepseek-v3", "DeepSeek-V3", 7168, 32, 2048, 8, note="32 of the 256 experts per layer"),
}

# --quick: a tiny layer whose rows still fit K-quants (multiples of 256), for the smoke test.
QUICK_SHAPE = LayerShape("tiny", "tiny (smoke test)", 256, 8, 256, 2)

DEFAULT_MODELS = ("qwen3", "gpt-oss", "deepseek-v3")
QUANT_TYPES = ("Q4_K_M", "Q8_0")
DEFAULT_TYPES = ("Q4_K_M", "Q8_0")
TOKENS_PER_DISPATCH = (1, 8, 64)

# The llama.cpp baseline file: the same layer with experts this narrow, so that the difference of
# the two decode times is the experts' (their remaining work is INNER_BASELINE / I of the real).
INNER_BASELINE = 32
