"""Text in and out: the model directory's (or GGUF file's) tokenizer, or UTF-8 bytes when it has none."""

from __future__ import annotations

from dataclasses import dataclass

from moeswarm.sources.source import as_source


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


_WHERE = {"hf": "the model directory", "gguf": "the GGUF metadata"}


def load_text_codec(path_or_source, vocab_size: int) -> TextCodec:
    """The source's tokenizer, or UTF-8 bytes when it has none. path_or_source: a path or a ModelSource."""
    source = as_source(path_or_source)
    where = _WHERE.get(source.kind, source.kind)
    tokenizer = source.load_tokenizer()
    if tokenizer is not None:
        return TextCodec(f"tokenizer ({where})", tokenizer, vocab_size)
    if vocab_size < 256:
        return TextCodec(f"utf-8 bytes modulo {vocab_size} (no tokenizer in {where})", None, vocab_size)
    return TextCodec(f"utf-8 bytes (no tokenizer in {where})", None, vocab_size)
