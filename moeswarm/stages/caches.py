"""A stage's sequence caches: the keys and values of its own layers, per (session, sequence).

The gateway decides what happens to a sequence between steps (generation/cache_journal.py); the
stage replays those records (`apply`) and then finds each segment's cache (`take`), checking that
it holds exactly the positions the gateway says it does: a stage that lost a sequence (restarted,
expired, evicted) says so in one line, and the gateway replays the sequence into it.

Bounded: at most `max_sequences` caches and `max_bytes` of keys and values; a sequence untouched
for `ttl_s` is dropped; past the byte bound the least recently used sequences not in the current
step are dropped first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from moeswarm.errors import ProtocolError
from moeswarm.generation.sequence_cache import SequenceCache
from moeswarm.stages.protocol import Segment


@dataclass(frozen=True)
class CacheLimits:
    max_sequences: int = 4096
    max_bytes: int = 4 << 30
    ttl_s: float = 600.0


class StageCaches:
    def __init__(self, limits: CacheLimits | None = None, dtype: torch.dtype | None = None, clock=time.monotonic):
        """dtype: what the caches keep (None: the model's dtype; torch.float16 with `--kv-cache f16`)."""
        self.limits = limits or CacheLimits()
        self.dtype = dtype
        self._clock = clock
        self._caches: OrderedDict[tuple[str, int], tuple[SequenceCache, float]] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._caches)

    def apply(self, session: str, records: tuple[tuple, ...]) -> None:
        """Replay the gateway's records (keep, crop, copy, close) in order; a record about a
        sequence this stage does not hold is skipped (its next segment will say it is missing)."""
        for record in records:
            kind, seq = record[0], record[1]
            cache = self._caches.get((session, seq), (None,))[0]
            if kind == "close":
                self._caches.pop((session, seq), None)
            elif kind == "copy":
                origin = self._caches.get((session, record[2]), (None,))[0]
                if origin is not None:
                    self._put(session, seq, origin.copy(record[3]))
            elif cache is None:
                continue
            elif kind == "keep":
                cache.keep_row(record[2])
            elif kind == "crop":
                if cache.pending:
                    cache.keep_row(0)  # a crop after branches the gateway kept none of: drop them
                cache.crop(record[2])

    def take(self, session: str, segments: tuple[Segment, ...]) -> list[SequenceCache]:
        """Each segment's cache (a new one for a sequence starting at position 0), checked against
        the positions the segment says come before it."""
        caches = []
        for segment in segments:
            key = (session, segment.seq)
            found = self._caches.get(key)
            if found is None:
                if segment.past != 0 or segment.row is not None:
                    raise ProtocolError(f"sequence {segment.seq} is not held here (expired, evicted or never "
                                        f"opened): replay its {segment.past} positions")
                if len(self._caches) >= self.limits.max_sequences:
                    self._evict(set(), need=1)
                if len(self._caches) >= self.limits.max_sequences:
                    raise ProtocolError(f"this stage holds {self.limits.max_sequences} sequences, its limit")
                cache = self._put(session, segment.seq, SequenceCache(dtype=self.dtype))
            else:
                cache = found[0]
                held = cache.length + (cache.pending_length if segment.row is not None else 0)
                if held != segment.past:
                    raise ProtocolError(f"sequence {segment.seq} holds {held} positions here, the step says "
                                        f"{segment.past}: replay it")
                self._caches.move_to_end(key)
                self._caches[key] = (cache, self._clock())
            caches.append(cache)
        return caches

    def settle(self, session: str, segments: tuple[Segment, ...]) -> None:
        """After a step: drop expired sequences, and the least recently used past the byte bound."""
        now = self._clock()
        for key in [k for k, (_, used) in self._caches.items() if now - used > self.limits.ttl_s]:
            del self._caches[key]
        if self.nbytes() > self.limits.max_bytes:
            self._evict({(session, s.seq) for s in segments}, need=0)

    def close_session(self, session: str) -> None:
        for key in [k for k in self._caches if k[0] == session]:
            del self._caches[key]

    def nbytes(self) -> int:
        return sum(_nbytes(cache) for cache, _ in self._caches.values())

    def _put(self, session: str, seq: int, cache: SequenceCache) -> SequenceCache:
        self._caches[(session, seq)] = (cache, self._clock())
        self._caches.move_to_end((session, seq))
        return cache

    def _evict(self, keep: set[tuple[str, int]], need: int) -> None:
        """Drop least recently used sequences not in `keep` until under the byte bound and `need`
        sequence slots are free."""
        held = self.nbytes()
        for key in list(self._caches):
            if held <= self.limits.max_bytes and len(self._caches) + need <= self.limits.max_sequences:
                return
            if key not in keep:
                held -= _nbytes(self._caches.pop(key)[0])

def _nbytes(cache: SequenceCache) -> int:
    held = sum(t.nbytes for t in cache.keys.values()) + sum(t.nbytes for t in cache.values.values())
    return held + sum(k.nbytes + v.nbytes for rows in cache.pending.values() for k, v in rows.values())
