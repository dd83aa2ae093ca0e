"""Draft tokens by n-gram lookup in the prompt and output (prompt lookup decoding)."""

from __future__ import annotations


def propose(tokens: list[int], max_draft: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the context's last n-gram.

    Tries n = max_ngram down to min_ngram; returns up to `max_draft` tokens, or [] when nothing matches.
    """
    if max_draft <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), max(1, min_ngram) - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + max_draft]
    return []
