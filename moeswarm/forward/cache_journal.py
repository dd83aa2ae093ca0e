"""What happened to a gateway's sequence caches between two steps, for stages that mirror them.

A chain of stages (moeswarm/stages/) holds each sequence's keys and values of its own layers. The
gateway's `SequenceCache` decides, between steps, which branch row is kept, where a sequence is
cropped after rejected drafts, which sequence starts as a copy of another's prompt, and which
sequences are gone; each decision is recorded here, in order, and the next step carries the
records to every stage, which replays them before its forward. Appending needs no record: a step's
rows are what the stages append.

Records are plain tuples (they travel in msgpack): ("keep", seq, row), ("crop", seq, length),
("copy", new_seq, from_seq, length), ("close", seq).
"""

from __future__ import annotations

import itertools
import threading
import weakref

Record = tuple


class Journal:
    """The records since the last `drain`, across every cache opened with this journal."""

    def __init__(self):
        self._records: list[Record] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def open(self, cache: object) -> int:
        """A new sequence id for `cache`; its close is recorded when the cache is garbage collected."""
        seq = next(self._ids)
        weakref.finalize(cache, self.record, ("close", seq))
        return seq

    def record(self, record: Record) -> None:
        with self._lock:
            self._records.append(record)

    def drain(self) -> list[Record]:
        """The records since the last drain, oldest first; the journal starts empty again."""
        with self._lock:
            records, self._records = self._records, []
        return records
