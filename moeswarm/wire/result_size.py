"""A RESULT's size on the wire, known from its DISPATCH: the worker bounds replies by it
(worker/limits.py, worker/replies.py) and the backbone cuts a share to fit it (dispatch/chunks.py),
so both sides count the same bytes.

No torch at import: the worker's flags take their defaults from worker/limits.py, which imports this.
"""

from __future__ import annotations

import functools
from typing import Any

RESULT_META_BYTES = 256  # a RESULT's header and metadata besides its expert lists (layer, mode, descriptor)
PER_EXPERT_META_BYTES = 18  # an expert id and its row count in msgpack: at most 9 bytes each
DEFAULT_MAX_RESULT_BYTES = 32 << 20  # a worker's --max-unsent-bytes unless set: the largest RESULT it sends


def reply_bytes(rows: int, hidden: int, combine: Any, experts: int) -> int:
    """A RESULT's size on the wire: `rows` x `hidden` values in the combine codec (exact), plus a
    bound on its metadata for `experts` listed experts (0 in partial mode). Unknown codecs count as
    f32, the largest float codec (the request is refused when decoded anyway)."""
    codec = _codecs().get(combine) if isinstance(combine, str) else None
    payload = codec.nbytes((rows, hidden)) if codec is not None else rows * hidden * 4
    return payload + RESULT_META_BYTES + PER_EXPERT_META_BYTES * experts


@functools.cache
def _codecs() -> dict:
    from moeswarm.wire.codecs import CODECS  # here: no torch at import

    return CODECS
