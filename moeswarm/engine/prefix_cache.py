"""KV caches of finished sequences, kept for the next request that starts with the same tokens.

A request whose prompt shares a prefix with a kept sequence (the same system prompt, the next
turn of a conversation) starts from a copy of that sequence's cache cut to the shared part, and
only prefills the rest. Entries are few and whole (one per finished sequence, least recently used
first out): a slot's cache stays with the conversation that made it.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from itertools import count


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, slots: int, chunk: int = 1):
        self.slots = slots
        self.chunk = chunk  # reuse whole prefill chunks only (engine/scheduler.py: the rest is prefilled as alone)
        self._entries: OrderedDict[int, tuple[list[int], object]] = OrderedDict()  # id -> (tokens in the cache, cache)
        self._ids = count()

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> list[object]:
        """The caches kept, oldest first (as `put` was given them)."""
        return [cache for _, cache in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()

    def take(self, prompt: list[int]) -> tuple[int, object | None]:
        """(reusable length, a private copy of the cache holding at least that many positions).

        At most len(prompt) - 1 positions are reused: the last prompt token is always fed, since
        its logits give the first new token; and a whole number of chunks, so that the rest of the
        prompt is prefilled in the chunks it would have alone. (0, None) on a miss.
        """
        best, best_id = 0, None
        for entry_id, (tokens, _) in self._entries.items():
            shared = min(common_prefix(tokens, prompt), len(prompt) - 1) // self.chunk * self.chunk
            if shared > best:
                best, best_id = shared, entry_id
        if best_id is None:
            return 0, None
        self._entries.move_to_end(best_id)
        return best, copy.deepcopy(self._entries[best_id][1])

    def put(self, tokens: list[int], cache: object) -> None:
        """Keep `cache`, which holds exactly `tokens`; an entry it extends is replaced."""
        if self.slots <= 0 or not tokens or cache is None:
            return
        for entry_id, (held, _) in list(self._entries.items()):
            if common_prefix(held, tokens) == len(held):
                del self._entries[entry_id]
        self._entries[next(self._ids)] = (list(tokens), cache)
        while len(self._entries) > self.slots:
            self._entries.popitem(last=False)
