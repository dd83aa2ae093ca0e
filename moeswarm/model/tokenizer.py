"""Text in and out: the model directory's (or GGUF file's) tokenizer, or UTF-8 bytes when it has none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer


@dataclass
class TextCodec:
    name: str
    tokenizer: object | None
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        # No tokenizer: UTF-8 bytes, folded into the vocabulary when it has fewer than 256 ids.
        return [byte % self.vocab_size for byte in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None


def load_text_codec(path: str | Path, vocab_size: int) -> TextCodec:
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        from moeswarm.weights.gguf_file import GGUFFile
        from moeswarm.weights.gguf_tokenizer import gguf_tokenizer

        f = GGUFFile.open(path)
        if "tokenizer.ggml.tokens" not in f.metadata:
            return TextCodec("utf-8 bytes (no tokenizer in the GGUF metadata)", None, vocab_size)
        return TextCodec("tokenizer (GGUF metadata)", gguf_tokenizer(f), vocab_size)
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        return TextCodec("tokenizer", AutoTokenizer.from_pretrained(path), vocab_size)
    name = "utf-8 bytes (no tokenizer in the model directory)"
    if vocab_size < 256:
        name = f"utf-8 bytes modulo {vocab_size} (no tokenizer in the model directory)"
    return TextCodec(name, None, vocab_size)
