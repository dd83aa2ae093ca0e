"""Checked layouts of received messages, known by their metadata bytes.

A decode step sends the same metadata bytes on every call of a layer with the same token count:
layer, mode, codecs, the tensors' shapes (everything but the tensors' bytes). Every check of a
message's metadata is a function of those bytes alone, so a layout found sound once is sound again
for the same bytes; what varies per frame is the payload (its length is the header's, checked per
frame) and the tensors' values (checked where they are used). The checks are many small Python
steps, each several times its hot-loop cost with the caches cold (a layer's experts just swept
them); a lookup of the bytes is one dict access.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from moeswarm.wire.frames import Frame
from moeswarm.wire.tensors import raw_numpy

L = TypeVar("L")


@dataclass(frozen=True)
class TensorAt:
    """Where one checked tensor lies in its frame's payload, and how it decodes."""

    offset: int
    size: int
    codec: object  # a wire.codecs codec
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self, payload: memoryview) -> torch.Tensor:
        return self.codec.decode(payload[self.offset : self.offset + self.size], self.shape, self.dtype)

    def array(self, payload: memoryview) -> np.ndarray:
        """The raw bytes as a read-only numpy array in the codec's own dtype (integer ids)."""
        return np.frombuffer(payload, raw_numpy(self.codec), math.prod(self.shape), self.offset).reshape(self.shape)


class KnownLayouts(Generic[L]):
    """{metadata bytes: the layout checked from them}, at most `limit` (then it starts over: a
    peer sending ever new metadata costs this table nothing but the checks it would pay anyway)."""

    def __init__(self, limit: int = 1024):
        self._limit = limit
        self._layouts: dict[bytes, L] = {}

    def get(self, frame: Frame) -> L | None:
        return None if frame.meta_bytes is None else self._layouts.get(frame.meta_bytes)

    def get_bytes(self, meta_bytes: bytes) -> L | None:
        """The layout known for these metadata bytes (a frame not decoded)."""
        return self._layouts.get(meta_bytes)

    def remember(self, frame: Frame, layout: L) -> None:
        if frame.meta_bytes is None:
            return
        if len(self._layouts) >= self._limit:
            self._layouts.clear()
        self._layouts[frame.meta_bytes] = layout
