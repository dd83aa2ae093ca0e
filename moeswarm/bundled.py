"""The models moeswarm ships or makes for itself: the demo's default."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINED = REPO / "models" / "pymoe" / "hf"
PROMPTS = REPO / "models" / "pymoe" / "prompts.jsonl"
DEMO_PROMPT = "def fibonacci(n):\n"


def demo_model() -> Path:
    """The trained model when it is there, else a tiny random qwen2_moe made once in the cache."""
    if (TRAINED / "config.json").is_file():
        return TRAINED
    from moeswarm.model.tiny import make_tiny_model

    cache = Path.home() / ".cache" / "moeswarm" / "demo-qwen2_moe-tiny"
    if not (cache / "config.json").is_file():
        make_tiny_model("qwen2_moe", cache, num_hidden_layers=4)
    return cache
