"""A stage's cache bounds hold against every record type (issue 62, item 3): copies and new
sequences are counted before they are applied, a session's own sequences go first, and another
session's only while the first holds less than its share."""

from __future__ import annotations

import time

import pytest
import torch

from moeswarm.errors import ProtocolError
from moeswarm.stages.caches import CacheLimits, StageCaches
from moeswarm.stages.protocol import Segment

UNIT = 2 * 4 * 32 * 4  # one position of one layer: keys and values, 4 heads of 32 floats


def _fill(caches: StageCaches, session: str, seq: int, positions: int) -> None:
    """A step opening `seq` with `positions` committed positions in one layer (as run_span would file them)."""
    segment = Segment(seq, None, 0, positions, 0)
    cache = caches.take(session, (segment,))[0]
    cache.append(0, torch.zeros(1, 4, positions, 32), torch.zeros(1, 4, positions, 32), None)
    caches.settle(session, (segment,))


def _recounted(caches: StageCaches) -> int:
    return sum(held.cache.nbytes for held in caches._held.values())


def test_forty_copies_against_a_small_budget_stay_within_it():
    caches = StageCaches(CacheLimits(max_sequences=4096, max_bytes=1 << 20, ttl_s=600))
    _fill(caches, "s", 1, 200)  # 200 positions: 200 x UNIT = 200 KiB
    records = tuple(("copy", 100 + i, 1, 200) for i in range(40))
    caches.apply("s", records, frozenset({1}))  # copies the step does not use: the session's oldest make room
    assert caches.nbytes() == _recounted(caches) <= 1 << 20
    assert sorted(seq for _, seq in caches._held) == [1, 136, 137, 138, 139]  # the origin and the last 4 copies
    used = frozenset({1} | {100 + i for i in range(40)})  # copies the step's segments name: none may go
    with pytest.raises(ProtocolError, match="more than the stage's cache lets this session hold"):
        caches.apply("s", tuple(("copy", 200 + i, 1, 200) for i in range(40)), used | {200 + i for i in range(40)})
    assert caches.nbytes() == _recounted(caches) <= 1 << 20


def test_a_session_opening_many_sequences_cannot_evict_another_beyond_its_share():
    caches = StageCaches(CacheLimits(max_sequences=8, max_bytes=1 << 30, ttl_s=600))
    for seq in range(1, 5):
        _fill(caches, "victim", seq, 1)
    flood = tuple(Segment(1000 + i, None, i, i + 1, 0) for i in range(8))
    with pytest.raises(ProtocolError, match="shared by 2 sessions"):
        caches.take("flood", flood)  # 8 new sequences: over its share of 8 / 2
    assert caches.sequences("victim") == 4 and caches.sequences("flood") == 0  # refused before anything moved
    caches.take("flood", flood[:4])  # its share fits beside the victim's four
    caches.take("flood", flood[4:6])  # more: its own least recently used go, not the victim's
    assert caches.sequences("victim") == 4 and caches.sequences("flood") == 4
    assert caches.nbytes() == _recounted(caches)


def test_a_session_under_its_share_takes_room_from_the_least_recently_used_other():
    caches = StageCaches(CacheLimits(max_sequences=4, max_bytes=1 << 30, ttl_s=600))
    for seq in range(1, 5):
        _fill(caches, "old", seq, 1)
    _fill(caches, "new", 1, 1)  # holds none: under its share of 4 / 2, so the other's oldest makes room
    assert caches.sequences("old") == 3 and caches.sequences("new") == 1
    with pytest.raises(ProtocolError, match="is not held here"):
        caches.take("old", (Segment(1, None, 0, 1, 1),))


def test_the_byte_bound_counts_a_steps_growth_before_it_runs():
    caches = StageCaches(CacheLimits(max_sequences=64, max_bytes=64 * UNIT, ttl_s=600))
    _fill(caches, "s", 1, 16)  # learns the layers' bytes per position
    with pytest.raises(ProtocolError, match="MiB"):
        caches.take("s", (Segment(2, None, 0, 100, 0),))  # 100 new positions of a new sequence: over the bound
    assert len(caches) == 1 and caches.nbytes() <= 64 * UNIT


def test_fixed_per_session_quota():
    caches = StageCaches(CacheLimits(max_sequences=100, max_bytes=1 << 30, ttl_s=600, session_sequences=2))
    _fill(caches, "s", 1, 1)
    _fill(caches, "s", 2, 1)
    with pytest.raises(ProtocolError):
        caches.take("s", tuple(Segment(10 + i, None, i, i + 1, 0) for i in range(3)))
    _fill(caches, "s", 3, 1)  # one new: its own oldest (1) goes
    assert caches.sequences("s") == 2


def test_eviction_and_expiry_cost_per_sequence_not_per_held_sequence():
    """4,096 one-row sequences opened by one step, then 4,096 more by another session: each eviction
    pops one entry (the old code summed every cache's size per new sequence)."""
    caches = StageCaches(CacheLimits(max_sequences=4096, max_bytes=1 << 40, ttl_s=600, session_sequences=4096))
    started = time.perf_counter()
    caches.take("a", tuple(Segment(1 + i, None, i, i + 1, 0) for i in range(4096)))
    caches.take("b", tuple(Segment(1 + i, None, i, i + 1, 0) for i in range(2048)))
    elapsed = time.perf_counter() - started
    assert caches.sequences("a") == 2048 and caches.sequences("b") == 2048
    assert elapsed < 5.0, elapsed  # the quadratic scan took minutes at this size


def test_closing_a_session_frees_its_bytes():
    caches = StageCaches(CacheLimits(max_sequences=10, max_bytes=1 << 30, ttl_s=600))
    _fill(caches, "a", 1, 3)
    _fill(caches, "b", 1, 5)
    caches.close_session("a")
    assert caches.nbytes() == _recounted(caches) == caches.session_nbytes("b") and len(caches) == 1
