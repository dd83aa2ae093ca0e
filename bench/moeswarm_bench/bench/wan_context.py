"""What each `moeswarm bench wan` scenario module gets: the workers behind their WAN links."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WanContext:
    model: str
    local_model: object  # the whole model, eager: the reference
    codec: object  # sources/tokenizer.py TextCodec
    prompts: dict[str, list[int]]  # "repetitive" / "non_repetitive" token ids
    addresses: list[str]  # the workers, direct
    links: object  # wan_links.WanLinks: the same workers behind one proxy each
    steps: int
    repeats: int
    new_tokens: int
    quick: bool
