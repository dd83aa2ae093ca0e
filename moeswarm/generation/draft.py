"""Draft tokens by n-gram lookup in the prompt and output (prompt lookup decoding)."""

from __future__ import annotations


def propose(tokens: list[int], max_draft: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the context's last n-gram.

    Tries n = max_ngram down to min_ngram; returns up to `max_draft` tokens, or [] when nothing matches.
    """
    found = propose_many(tokens, max_draft, 1, max_ngram, min_ngram)
    return found[0] if found else []


def propose_many(tokens: list[int], max_draft: int, most: int, max_ngram: int = 3, min_ngram: int = 1) -> list[list[int]]:
    """Up to `most` distinct continuations of the context's last n-gram: what followed its earlier
    occurrences, the longest n-gram's first, the latest occurrence first within one n.

    propose()'s draft is the first of them. [] when nothing matches.
    """
    if max_draft <= 0 or most <= 0:
        return []
    found: list[list[int]] = []
    for n in range(min(max_ngram, len(tokens) - 1), max(1, min_ngram) - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                continuation = tokens[start + n : start + n + max_draft]
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == most:
                        return found
    return found
