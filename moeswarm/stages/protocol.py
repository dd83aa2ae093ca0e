"""The stage protocol: a step's rows from the gateway through a chain of stages and back.

Frames are the workers' (wire/frames.py: magic, version, opcode, request id, msgpack metadata,
raw payload), with two opcodes of their own (docs/stages.md):

HELLO        gateway -> stage: {"role": "gateway", "session", "fingerprint"} and, in a chain,
             {"upstream"} (not to the first stage), {"onward", "onward_token"} (not to the last);
             stage -> stage: {"role": "stage", "fingerprint"};
             stage's answer: {"role": "stage", "fingerprint", "layers": [first, last], "hidden_size"}
STEP         gateway -> first stage, stage -> next stage: {"session", "step", "route", "records",
             "segments", "tensors"}, and from a stage {"token"} (stages/sessions.py); payload: the
             hidden states [T, d] entering the stage
STEP_RESULT  last stage -> gateway: {"session", "step", "tensors"}; payload: the hidden states [T, d]
             after the chain's last layer
ERROR        any stage -> gateway: {"code", "message", "session", "step"}
PING/PONG    liveness

`route` is the stages still to visit after the receiver (HOST:PORT each); an empty route means the
receiver is the last and answers the gateway on the gateway's own connection (every stage of a
chain has one: the session). `records` are the gateway's cache records since its last step
(forward/cache_journal.py), replayed by every stage before its forward. A segment is
[seq, row, start, end, past]: tokens [start, end) of the step belong to sequence `seq`, branch
`row` (-1: its committed context), after `past` positions.

Every field is checked before use; a bad one is a ProtocolError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeswarm.errors import ProtocolError
from moeswarm.wire import tensors as wire_tensors
from moeswarm.wire.codecs import lossless_codec
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import field

MAX_ROUTE = 32  # stages after the first: far more than a chain needs
MAX_SEGMENTS = 4096
MAX_RECORDS = 1 << 16
MAX_SESSION_CHARS = 64
NO_ROW = -1
RECORD_ARITY = {"keep": 3, "crop": 3, "copy": 4, "close": 2}


@dataclass(frozen=True)
class Segment:
    seq: int
    row: int | None  # None: the sequence's committed context
    start: int
    end: int
    past: int


@dataclass(frozen=True)
class Step:
    """One STEP: the rows of many sequences entering a stage."""

    session: str
    step: int
    route: tuple[str, ...]
    records: tuple[tuple, ...]
    segments: tuple[Segment, ...]
    hidden: torch.Tensor  # [T, d]
    token: str = ""  # a stage's link token for the session ("" from the gateway)

    def to_frame(self) -> Frame:
        descriptors, buffers = wire_tensors.pack([("hidden", self.hidden.contiguous(), lossless_codec(self.hidden.dtype))])
        meta = {"session": self.session, "step": self.step, "route": list(self.route),
                "records": [list(r) for r in self.records],
                "segments": [[s.seq, NO_ROW if s.row is None else s.row, s.start, s.end, s.past] for s in self.segments],
                "tensors": descriptors}
        if self.token:
            meta["token"] = self.token
        return Frame(Opcode.STEP, self.step, meta, tuple(buffers))

    @classmethod
    def from_frame(cls, frame: Frame, hidden_size: int, max_tokens: int) -> "Step":
        meta = frame.meta
        session, step = _session(meta), field(meta, "step", int)
        if not 0 <= step < 1 << 63:
            raise ProtocolError(f"metadata field 'step' must be 0 to 2**63 - 1, got {step}")
        route = field(meta, "route", list)
        if len(route) > MAX_ROUTE or not all(isinstance(a, str) and 0 < len(a) <= 300 for a in route):
            raise ProtocolError(f"metadata field 'route' must list at most {MAX_ROUTE} HOST:PORT strings")
        hidden = _hidden(meta, frame.payload, hidden_size, max_tokens)
        segments = _segments(field(meta, "segments", list), hidden.shape[0])
        records = _records(field(meta, "records", list))
        token = meta.get("token", "")
        if not isinstance(token, str) or len(token) > MAX_SESSION_CHARS:
            raise ProtocolError(f"metadata field 'token' must be at most {MAX_SESSION_CHARS} characters")
        return cls(session, step, tuple(route), records, segments, hidden, token)


def result_frame(session: str, step: int, hidden: torch.Tensor) -> Frame:
    descriptors, buffers = wire_tensors.pack([("hidden", hidden.contiguous(), lossless_codec(hidden.dtype))])
    return Frame(Opcode.STEP_RESULT, step, {"session": session, "step": step, "tensors": descriptors}, tuple(buffers))


def parse_result(frame: Frame, hidden_size: int, max_tokens: int) -> tuple[int, torch.Tensor]:
    """(step, hidden [T, d]) of a STEP_RESULT."""
    return field(frame.meta, "step", int), _hidden(frame.meta, frame.payload, hidden_size, max_tokens)


def error_frame(session: str, step: int, code: str, message: str) -> Frame:
    return Frame(Opcode.ERROR, step, {"code": code, "message": message, "session": session, "step": step})


def _session(meta: dict[str, Any]) -> str:
    session = field(meta, "session", str)
    if not 0 < len(session) <= MAX_SESSION_CHARS or not session.isprintable():
        raise ProtocolError(f"metadata field 'session' must be 1-{MAX_SESSION_CHARS} printable characters")
    return session


def _hidden(meta: dict[str, Any], payload, hidden_size: int, max_tokens: int) -> torch.Tensor:
    descriptors = field(meta, "tensors", list)
    if len(descriptors) != 1 or not isinstance(descriptors[0], list) or not descriptors[0] or descriptors[0][0] != "hidden":
        raise ProtocolError("a step carries exactly one tensor, 'hidden'")
    shape = descriptors[0][3] if len(descriptors[0]) == 4 else None
    if not (isinstance(shape, list) and len(shape) == 2 and shape[1] == hidden_size
            and isinstance(shape[0], int) and 0 < shape[0] <= max_tokens):
        raise ProtocolError(f"hidden states must be [tokens <= {max_tokens}, {hidden_size}], got {shape!r:.80}")
    hidden = wire_tensors.unpack(descriptors, payload)["hidden"]  # [T, d]
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ProtocolError(f"hidden states must be float32, bfloat16 or float16, got {hidden.dtype}")
    return hidden


def _segments(raw: list, tokens: int) -> tuple[Segment, ...]:
    if not 0 < len(raw) <= MAX_SEGMENTS:
        raise ProtocolError(f"a step has 1-{MAX_SEGMENTS} segments, got {len(raw)}")
    segments, at = [], 0
    for i, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 5 and all(_is_int(v) for v in item)):
            raise ProtocolError(f"segment {i} must be [seq, row, start, end, past] integers")
        seq, row, start, end, past = item
        if start != at or end <= start or end > tokens or not 0 <= past < 1 << 40 or not 0 < seq < 1 << 63 \
                or not NO_ROW <= row < MAX_SEGMENTS:
            raise ProtocolError(f"segment {i} {item!r:.80} does not continue the step's rows at {at} of {tokens}")
        segments.append(Segment(seq, None if row == NO_ROW else row, start, end, past))
        at = end
    if at != tokens:
        raise ProtocolError(f"segments cover {at} of the step's {tokens} rows")
    return tuple(segments)


def _records(raw: list) -> tuple[tuple, ...]:
    if len(raw) > MAX_RECORDS:
        raise ProtocolError(f"a step carries at most {MAX_RECORDS} cache records, got {len(raw)}")
    records = []
    for i, item in enumerate(raw):
        if not (isinstance(item, list) and item and item[0] in RECORD_ARITY and len(item) == RECORD_ARITY[item[0]]
                and all(_is_int(v) and 0 <= v < 1 << 63 for v in item[1:])):
            raise ProtocolError(f"cache record {i} {item!r:.80} is not keep/crop/copy/close with its counts")
        records.append(tuple(item))
    return tuple(records)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
