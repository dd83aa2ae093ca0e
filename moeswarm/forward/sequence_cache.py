"""A sequence's own keys and values, for packed forwards (forward/packed.py).

Per attention layer, the keys and values of every position the sequence has fed, in buffers that
grow by doubling (a decode step appends in place instead of copying the whole cache); alternative
draft rows keep theirs aside until one is kept.

The entries are kept in the model's dtype (float32 for every backbone here) or, with `--kv-cache
f16`, as float16, as llama.cpp keeps its cache: half the bytes a position, so half the memory a
sequence holds and half the bytes a decode step's attention reads. Every entry is rounded to the
cache's dtype once, as it is filed (a branch row's too, kept aside), so a position attends to the
same values whichever way its keys were fed; the attention widens them where it reads them
(qkernels.attend_one reads float16 directly).

Legend: H = key/value heads, D = head size, n = new positions, m = a branch's positions aside.
"""

from __future__ import annotations

import torch


class SequenceCache:
    """One sequence's keys and values, per attention layer, in buffers that grow by doubling.

    Alternative rows (branches) of a step keep their new entries aside (`pending`) until one row
    is kept. With a `journal` (forward/cache_journal.py), every keep, crop, copy and close is
    recorded under this cache's `id`, for the stages that hold this sequence's other layers."""

    def __init__(self, journal=None, dtype: torch.dtype | None = None):
        """dtype: what the entries are kept as (None: the dtype of the first keys and values filed)."""
        self.dtype = dtype
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [1, H, capacity, D]
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}
        self.pending: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> row -> ([1, H, m, D] x2)
        self.rows = 1  # rows fed since the last keep_row
        self.journal = journal
        self.id = journal.open(self) if journal is not None else None

    @property
    def length(self) -> int:
        return min(self.lengths.values(), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes its buffers hold: every layer's capacity (a crop keeps it), and branches' entries aside."""
        aside = sum(k.nbytes + v.nbytes for held in self.pending.values() for k, v in held.values())
        return sum(t.nbytes for t in self.keys.values()) + sum(t.nbytes for t in self.values.values()) + aside

    @property
    def pending_length(self) -> int:
        """Positions each branch row holds aside (a branch continued over several forwards)."""
        held = next(iter(self.pending.values()), {})
        return next(iter(held.values()))[0].shape[2] if held else 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, row: int | None) -> None:
        """keys, values [1, H, n, D*]: new positions, committed (row None) or aside for branch `row`."""
        if self.dtype is not None:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        if row is not None:
            held = self.pending.setdefault(layer, {})
            if row in held:
                keys, values = torch.cat([held[row][0], keys], dim=2), torch.cat([held[row][1], values], dim=2)
            held[row] = (keys, values)
            return
        self._commit(layer, keys, values)

    def _commit(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        length, n = self.lengths.get(layer, 0), keys.shape[2]
        buffer = self.keys.get(layer)
        if buffer is None or buffer.shape[2] < length + n:
            capacity = max(length + n, 2 * (0 if buffer is None else buffer.shape[2]), 16)
            grown_k = keys.new_empty(keys.shape[:2] + (capacity,) + keys.shape[3:])  # [1, H, capacity, D]
            grown_v = values.new_empty(values.shape[:2] + (capacity,) + values.shape[3:])
            if length:
                grown_k[:, :, :length] = self.keys[layer][:, :, :length]
                grown_v[:, :, :length] = self.values[layer][:, :, :length]
            self.keys[layer], self.values[layer] = grown_k, grown_v
        self.keys[layer][:, :, length : length + n] = keys
        self.values[layer][:, :, length : length + n] = values
        self.lengths[layer] = length + n

    def view(self, layer: int, row: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position `row` (None: the committed context) sees at `layer`: ([1, H, p + m, D] x2)."""
        length = self.lengths.get(layer, 0)
        keys, values = self.keys[layer][:, :, :length], self.values[layer][:, :, :length]
        if row is None:
            return keys, values
        extra_k, extra_v = self.pending[layer][row]
        return torch.cat([keys, extra_k], dim=2), torch.cat([values, extra_v], dim=2)

    @torch.inference_mode()
    def keep_row(self, row: int) -> None:
        """Commit branch `row`'s pending entries; drop the other rows'."""
        if self.journal is not None and (self.pending or self.rows > 1):
            self.journal.record(("keep", self.id, row))
        for layer, held in self.pending.items():
            if row in held:
                self._commit(layer, *held[row])
        self.pending.clear()
        self.rows = 1

    def copy(self, length: int) -> "SequenceCache":
        """A cache of its own holding this one's first `length` committed positions (no branches)."""
        twin = SequenceCache(self.journal, self.dtype)
        if self.journal is not None:
            self.journal.record(("copy", twin.id, self.id, length))
        for layer in self.lengths:
            keep = min(length, self.lengths[layer])
            twin._commit(layer, self.keys[layer][:, :, :keep].clone(), self.values[layer][:, :, :keep].clone())
        return twin

    def crop(self, length: int) -> None:
        if self.pending:
            raise ValueError("crop with branches pending: keep one row first")
        if self.journal is not None and length < self.length:
            self.journal.record(("crop", self.id, length))
        for layer in self.lengths:
            self.lengths[layer] = min(self.lengths[layer], length)


def cache_bytes(cache) -> int:
    """Bytes of keys and values a stepper's cache holds: a SequenceCache's buffers, or the tensors of a
    transformers cache's layers (a threaded family's); 0 for none."""
    if cache is None:
        return 0
    if isinstance(cache, SequenceCache):
        return cache.nbytes
    tensors = [getattr(layer, name, None) for layer in getattr(cache, "layers", ()) for name in ("keys", "values")]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
