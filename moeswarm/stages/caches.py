"""A stage's sequence caches: the keys and values of its own layers, per (session, sequence).

The gateway decides what happens to a sequence between steps (forward/cache_journal.py); the
stage replays those records (`apply`) and then finds each segment's cache (`take`), checking that
it holds exactly the positions the gateway says it does: a stage that lost a sequence (restarted,
expired, evicted) says so in one line, and the gateway replays the sequence into it.

Bounded against every record type: at most `max_sequences` caches and `max_bytes` of keys and
values. What a copy record allocates, how many sequences a step opens, and what a step's new
positions add (from the buffers' sizes: a buffer grows by doubling) are counted before they are
applied. Room is made in this order: the session's own least recently used sequences not in the
step; then, only while the session holds less than its share (the stage's bounds divided by the
sessions holding caches, or the fixed per-session quota where one is set), other sessions' least
recently used. A step that still does not fit is refused (ProtocolError) before anything is
allocated. A sequence untouched for `ttl_s` is dropped. Each sequence's size is kept with it and
the totals are running sums, so admitting, evicting and expiring cost O(1) per sequence.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from moeswarm.errors import ProtocolError
from moeswarm.forward.sequence_cache import SequenceCache
from moeswarm.stages.protocol import Segment

Key = tuple[str, int]  # (session, sequence)
MIB = 1 << 20


@dataclass(frozen=True)
class CacheLimits:
    """max_sequences, max_bytes: the stage's bounds (`--max-sequences`, `--max-cache-mb`).
    session_sequences, session_bytes: a fixed quota per session (0: the session's fair share only)."""

    max_sequences: int = 4096
    max_bytes: int = 4 << 30
    ttl_s: float = 600.0
    session_sequences: int = 0
    session_bytes: int = 0


class _Held:
    __slots__ = ("cache", "used", "nbytes")

    def __init__(self, cache: SequenceCache, used: float):
        self.cache, self.used, self.nbytes = cache, used, cache.nbytes


class StageCaches:
    def __init__(self, limits: CacheLimits | None = None, dtype: torch.dtype | None = None, clock=time.monotonic):
        """dtype: what the caches keep (None: the model's dtype; torch.float16 with `--kv-cache f16`)."""
        self.limits = limits or CacheLimits()
        self.dtype = dtype
        self._clock = clock
        self._held: OrderedDict[Key, _Held] = OrderedDict()  # oldest use first
        self._sessions: dict[str, OrderedDict[Key, None]] = {}  # each session's keys, oldest use first
        self._session_bytes: dict[str, int] = {}
        self._bytes = 0
        self._units: dict[int, int] | None = None  # layer -> bytes a position, once a cache has shown it
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._held)

    def nbytes(self) -> int:
        """Bytes of keys and values held (a running sum)."""
        return self._bytes

    def session_nbytes(self, session: str) -> int:
        return self._session_bytes.get(session, 0)

    def sequences(self, session: str) -> int:
        return len(self._sessions.get(session, ()))

    # -- the records and the step ------------------------------------------------------------------

    def apply(self, session: str, records: tuple[tuple, ...], step: frozenset[int] = frozenset()) -> None:
        """Replay the gateway's records (keep, crop, copy, close) in order; a record about a
        sequence this stage does not hold is skipped (its next segment will say it is missing).
        step: the sequences the step's segments name (never evicted to make room for a copy).
        ProtocolError, before the copy is made, when a copy does not fit (see the module's rules)."""
        for record in records:
            kind, seq = record[0], record[1]
            key = (session, seq)
            held = self._held.get(key)
            if kind == "close":
                if held is not None:
                    self._drop(key)
            elif kind == "copy":
                origin = self._held.get((session, record[2]))
                if origin is not None:
                    need = _copy_bytes(origin.cache, record[3]) - (held.nbytes if held is not None else 0)
                    self._make_room(session, need, 0 if held is not None else 1, step | {seq, record[2]})
                    self._put(key, origin.cache.copy(record[3]))
            elif held is None:
                continue
            elif kind == "keep":
                held.cache.keep_row(record[2])
                self._recount(key)
            elif kind == "crop":
                if held.cache.pending:
                    held.cache.keep_row(0)  # a crop after branches the gateway kept none of: drop them
                held.cache.crop(record[2])
                self._recount(key)
        if self._bytes > self.limits.max_bytes:  # a kept row committed past the bound: the step's own stay
            self._make_room(session, 0, 0, step)

    def take(self, session: str, segments: tuple[Segment, ...]) -> list[SequenceCache]:
        """Each segment's cache (a new one for a sequence starting at position 0), checked against
        the positions the segment says come before it. The sequences it opens and the bytes its new
        positions will add are made room for first (ProtocolError when they do not fit)."""
        step = frozenset(s.seq for s in segments)
        opening: set[int] = set()
        growth = 0
        for segment in segments:
            found = self._held.get((session, segment.seq))
            if found is None:
                if segment.past != 0 or segment.row is not None:
                    raise ProtocolError(f"sequence {segment.seq} is not held here (expired, evicted or never "
                                        f"opened): replay its {segment.past} positions")
                if segment.seq not in opening:
                    opening.add(segment.seq)
                    growth += self._new_bytes(segment.end - segment.start)
                continue
            cache = found.cache
            held = cache.length + (cache.pending_length if segment.row is not None else 0)
            if held != segment.past:
                raise ProtocolError(f"sequence {segment.seq} holds {held} positions here, the step says "
                                    f"{segment.past}: replay it")
            growth += _growth_bytes(cache, segment.end - segment.start, segment.row)
        self._make_room(session, growth, len(opening), step)
        now = self._clock()
        caches = []
        for segment in segments:
            key = (session, segment.seq)
            found = self._held.get(key)
            if found is None:
                self._put(key, SequenceCache(dtype=self.dtype))
                found = self._held[key]
            found.used = now
            self._touch(key)
            caches.append(found.cache)
        return caches

    def settle(self, session: str, segments: tuple[Segment, ...]) -> None:
        """After a step: its sequences' sizes counted, expired sequences dropped, and room made past the bounds."""
        for key in {(session, s.seq) for s in segments}:
            if key in self._held:
                self._recount(key)
                self._learn(self._held[key].cache)
        now = self._clock()
        while self._held:
            key, held = next(iter(self._held.items()))
            if now - held.used <= self.limits.ttl_s:
                break
            self._drop(key)
        if self._bytes > self.limits.max_bytes:
            try:
                self._make_room(session, 0, 0, frozenset(s.seq for s in segments))
            except ProtocolError:  # the step's own sequences alone are past the bound: they go, not others'
                for key in {(session, s.seq) for s in segments}:
                    if key in self._held:
                        self._drop(key)

    def close_session(self, session: str) -> None:
        for key in list(self._sessions.get(session, ())):
            self._drop(key)

    # -- accounting --------------------------------------------------------------------------------

    def _make_room(self, session: str, need_bytes: int, need_slots: int, step: frozenset[int]) -> None:
        """Evict until `need_bytes` and `need_slots` more fit, by the module's rules; ProtocolError,
        with nothing evicted, when they cannot."""
        limits = self.limits
        own = self._sessions.get(session, OrderedDict())
        mine_bytes, mine_slots = self._session_bytes.get(session, 0), len(own)
        quota_bytes, quota_slots = limits.session_bytes or limits.max_bytes, limits.session_sequences or limits.max_sequences
        if self._fits(need_bytes, need_slots) and mine_bytes + need_bytes <= quota_bytes and \
                mine_slots + need_slots <= quota_slots:
            return
        kept = [(session, seq) for seq in step if (session, seq) in self._held]  # the step's own: never evicted
        kept_bytes = sum(self._held[key].nbytes for key in kept)
        holders = len(self._sessions) + (session not in self._sessions)
        share_bytes = min(quota_bytes, limits.max_bytes // holders)
        share_slots = min(quota_slots, max(1, limits.max_sequences // holders))
        takes_others = kept_bytes + need_bytes <= share_bytes and len(kept) + need_slots <= share_slots
        floor_bytes = self._bytes - (mine_bytes - kept_bytes) - ((self._bytes - mine_bytes) if takes_others else 0)
        floor_slots = len(self._held) - (mine_slots - len(kept)) - ((len(self._held) - mine_slots) if takes_others else 0)
        if floor_bytes + need_bytes > limits.max_bytes or floor_slots + need_slots > limits.max_sequences or \
                kept_bytes + need_bytes > quota_bytes or len(kept) + need_slots > quota_slots:
            raise ProtocolError(
                f"this step needs {max(need_bytes, 0) / MIB:.1f} MiB and {need_slots} new sequences more than the "
                f"stage's cache lets this session hold (it holds {mine_slots} sequences, {mine_bytes / MIB:.1f} MiB; "
                f"the stage {len(self._held)} of {limits.max_sequences}, {self._bytes / MIB:.1f} of "
                f"{limits.max_bytes / MIB:.0f} MiB, shared by {holders} sessions)")

        def own_enough(freed_bytes: int, freed_slots: int) -> bool:
            return self._fits(need_bytes - freed_bytes, need_slots - freed_slots) and \
                mine_bytes - freed_bytes + need_bytes <= quota_bytes and mine_slots - freed_slots + need_slots <= quota_slots

        self._evict_from(own, session, own_enough, step, others=False)
        if not self._fits(need_bytes, need_slots):
            self._evict_from(self._held, session, lambda b, n: self._fits(need_bytes - b, need_slots - n), step,
                             others=True)

    def _fits(self, need_bytes: int, need_slots: int) -> bool:
        return self._bytes + need_bytes <= self.limits.max_bytes and \
            len(self._held) + need_slots <= self.limits.max_sequences

    def _evict_from(self, order, session: str, enough, step: frozenset[int], others: bool) -> None:
        """Drop keys of `order` (oldest first) until `enough(freed bytes, freed sequences)`: `others`:
        other sessions' only, else `session`'s own; never the step's. Walks past at most the step's own keys."""
        freed_bytes = freed_slots = 0
        victims = []
        for key in order:
            if enough(freed_bytes, freed_slots):
                break
            if (key[0] == session) == others or key[1] in step and key[0] == session:
                continue
            victims.append(key)
            freed_bytes += self._held[key].nbytes
            freed_slots += 1
        for key in victims:
            self._drop(key)
            self.evicted += 1

    def _put(self, key: Key, cache: SequenceCache) -> None:
        if key in self._held:
            self._drop(key)
        held = _Held(cache, self._clock())
        self._held[key] = held
        self._sessions.setdefault(key[0], OrderedDict())[key] = None
        self._bytes += held.nbytes
        self._session_bytes[key[0]] = self._session_bytes.get(key[0], 0) + held.nbytes

    def _drop(self, key: Key) -> None:
        held = self._held.pop(key)
        own = self._sessions[key[0]]
        del own[key]
        self._bytes -= held.nbytes
        self._session_bytes[key[0]] -= held.nbytes
        if not own:
            del self._sessions[key[0]], self._session_bytes[key[0]]

    def _touch(self, key: Key) -> None:
        self._held.move_to_end(key)
        self._sessions[key[0]].move_to_end(key)

    def _recount(self, key: Key) -> None:
        held = self._held[key]
        size = held.cache.nbytes
        self._bytes += size - held.nbytes
        self._session_bytes[key[0]] += size - held.nbytes
        held.nbytes = size

    def _learn(self, cache: SequenceCache) -> None:
        if self._units is None and cache.keys:
            self._units = _units(cache)

    def _new_bytes(self, positions: int) -> int:
        """What a new sequence's first `positions` take (0 until a cache has shown the layers' sizes)."""
        return sum(max(positions, 16) * unit for unit in (self._units or {}).values())


def _units(cache: SequenceCache) -> dict[int, int]:
    """layer -> bytes of one position's keys and values."""
    return {layer: (cache.keys[layer].nbytes + cache.values[layer].nbytes) // max(1, cache.keys[layer].shape[2])
            for layer in cache.keys}


def _copy_bytes(cache: SequenceCache, length: int) -> int:
    """What `cache.copy(length)` allocates: each layer's first `length` positions in a buffer of at least 16."""
    units = _units(cache)
    return sum(max(min(length, cache.lengths[layer]), 16) * units[layer] for layer in units)


def _growth_bytes(cache: SequenceCache, positions: int, row: int | None) -> int:
    """What appending `positions` to `cache` (committed, or aside for branch `row`) allocates at most."""
    units, grown = _units(cache), 0
    for layer, unit in units.items():
        if row is not None:
            grown += positions * unit  # aside: a new tensor of the branch's positions
            continue
        length, capacity = cache.lengths[layer], cache.keys[layer].shape[2]
        if length + positions > capacity:
            grown += (max(length + positions, 2 * capacity, 16) - capacity) * unit
    return grown
