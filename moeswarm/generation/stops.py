"""Stop strings: where the output ends, and how much of a streamed text must wait.

Text is checked, not tokens: a stop string may span several tokens, or start inside one.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """The index where the earliest stop string in `text` starts, or None when there is none."""
    found = [index for index in (text.find(stop) for stop in stops if stop) if index >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string.

    `text[:len(text) - held_back(text, stops)]` is safe to stream: no stop string can end up
    starting inside it, whatever comes next (a stop already wholly in `text` is `find_stop`'s).
    """
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
