"""Typed messages of protocol v1 and their frames.

HELLO      backbone -> worker: {"fingerprint", "role"}; worker -> backbone: WorkerInfo
DISPATCH   backbone -> worker: one MoE layer, all tokens of the step routed to this worker
RESULT     worker -> backbone: the experts' outputs for a DISPATCH
ERROR      either way: {"code", "message"}; the connection stays usable unless framing broke
PING/PONG  liveness, empty metadata
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeswarm.errors import ProtocolError
from moeswarm.wire import tensors as wire_tensors
from moeswarm.wire.codecs import get_codec, lossless_codec
from moeswarm.wire.frames import Frame, Opcode

PROTOCOL_VERSION = 1
COMBINE_MODES = ("exact", "partial")


def field(meta: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A required metadata field of the given type, or ProtocolError naming it."""
    value = meta.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"metadata field {name!r} missing or not {getattr(kind, '__name__', kind)}: {value!r}")
    return value


@dataclass(frozen=True)
class Hello:
    fingerprint: str
    role: str = "backbone"

    def to_frame(self, request_id: int) -> Frame:
        meta = {"protocol": PROTOCOL_VERSION, "fingerprint": self.fingerprint, "role": self.role}
        return Frame(Opcode.HELLO, request_id, meta)

    @classmethod
    def from_frame(cls, frame: Frame) -> "Hello":
        return cls(field(frame.meta, "fingerprint", str), str(frame.meta.get("role", "backbone")))


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker serves: its answer to HELLO."""

    fingerprint: str
    model_type: str
    num_experts: int
    hidden_size: int
    layers: list[int]
    experts: list[int]
    codecs: list[str]

    def to_frame(self, request_id: int) -> Frame:
        return Frame(Opcode.HELLO, request_id, {"protocol": PROTOCOL_VERSION, **self.__dict__})

    @classmethod
    def from_frame(cls, frame: Frame) -> "WorkerInfo":
        m = frame.meta
        return cls(
            field(m, "fingerprint", str),
            field(m, "model_type", str),
            field(m, "num_experts", int),
            field(m, "hidden_size", int),
            [int(x) for x in field(m, "layers", list)],
            [int(x) for x in field(m, "experts", list)],
            [str(x) for x in field(m, "codecs", list)],
        )


@dataclass(frozen=True)
class Dispatch:
    """One MoE layer's work for one worker.

    hidden         [T, d] hidden states of the tokens that use at least one of this worker's experts
    top_k_index    [T, k] int, the router's choices; -1 where the expert lives on another worker
    top_k_weights  [T, k] the router's weights, same dtype as the model's

    On the wire the tensors are named x, ids and w (short names: metadata bytes count on a reduced
    decode step). ids travel as u8 (ids < 255, with 255 for -1), else i16 or i32.
    """

    layer: int
    hidden: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    mode: str = "exact"
    wire_dispatch: str = "f32"
    wire_combine: str = "f32"

    def to_frame(self, request_id: int) -> Frame:
        descriptors, buffers = wire_tensors.pack(
            [
                ("x", self.hidden, self.wire_dispatch),
                ("ids", *_compact_ids(self.top_k_index)),
                ("w", self.top_k_weights, lossless_codec(self.top_k_weights.dtype)),
            ]
        )
        meta = {"layer": self.layer, "mode": self.mode, "combine": self.wire_combine, "tensors": descriptors}
        return Frame(Opcode.DISPATCH, request_id, meta, _join(buffers))

    @classmethod
    def from_frame(cls, frame: Frame) -> "Dispatch":
        m = frame.meta
        mode = field(m, "mode", str)
        if mode not in COMBINE_MODES:
            raise ProtocolError(f"unknown combine mode {mode!r} (known: {', '.join(COMBINE_MODES)})")
        descriptors = field(m, "tensors", list)
        tensors = wire_tensors.unpack(descriptors, frame.payload)
        for name in ("x", "ids", "w"):
            if name not in tensors:
                raise ProtocolError(f"DISPATCH lacks tensor {name!r}")
        hidden, index, weights = tensors["x"], tensors["ids"], tensors["w"]
        if hidden.dim() != 2 or index.dim() != 2 or index.shape != weights.shape or index.shape[0] != hidden.shape[0]:
            raise ProtocolError(
                f"DISPATCH shapes do not match: x {list(hidden.shape)} (want [T, d]), "
                f"ids {list(index.shape)} and w {list(weights.shape)} (want [T, k])"
            )
        if index.is_floating_point():
            raise ProtocolError(f"expert ids must be integers, got {index.dtype}")
        codec_of = {d[0]: d[1] for d in descriptors}
        index = index.long()
        if codec_of["ids"] == "u8":
            index = torch.where(index == 255, -1, index)
        wire_dispatch = codec_of["x"]
        combine = field(m, "combine", str)
        get_codec(combine)  # an unknown combine codec is refused now, not after the experts ran
        return cls(field(m, "layer", int), hidden, index, weights, mode, wire_dispatch, combine)


@dataclass(frozen=True)
class Result:
    """The answer to a DISPATCH.

    exact:   experts [n] ascending, counts [n] rows per expert, outputs [sum(counts), d]: row block i
             is w * E_experts[i](x) for the expert's rows in eager order (slot-major, then token)
    partial: outputs [T, d]: per dispatched token, the weighted sum over this worker's experts
             (experts and counts are not sent)

    On the wire the outputs tensor is named y.
    """

    layer: int
    mode: str
    outputs: torch.Tensor
    experts: list[int]
    counts: list[int]
    wire_combine: str = "f32"

    def to_frame(self, request_id: int) -> Frame:
        descriptors, buffers = wire_tensors.pack([("y", self.outputs, self.wire_combine)])
        meta = {"layer": self.layer, "mode": self.mode, "tensors": descriptors}
        if self.mode == "exact":
            meta.update(experts=self.experts, counts=self.counts)
        return Frame(Opcode.RESULT, request_id, meta, _join(buffers))

    @classmethod
    def from_frame(cls, frame: Frame) -> "Result":
        m = frame.meta
        outputs = wire_tensors.unpack(field(m, "tensors", list), frame.payload).get("y")
        if outputs is None or outputs.dim() != 2:
            raise ProtocolError("RESULT must carry a 2-d tensor 'y'")
        mode = field(m, "mode", str)
        if mode == "exact":
            experts = [int(x) for x in field(m, "experts", list)]
            counts = [int(x) for x in field(m, "counts", list)]
        else:
            experts, counts = [], []
        return cls(field(m, "layer", int), mode, outputs, experts, counts)


@dataclass(frozen=True)
class ErrorReply:
    code: str
    message: str

    def to_frame(self, request_id: int) -> Frame:
        return Frame(Opcode.ERROR, request_id, {"code": self.code, "message": self.message})

    @classmethod
    def from_frame(cls, frame: Frame) -> "ErrorReply":
        return cls(str(frame.meta.get("code", "error")), str(frame.meta.get("message", "(no message)")))


def _compact_ids(index: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Expert ids in the smallest integer codec that holds them (u8 maps -1 to 255)."""
    largest = int(index.max()) if index.numel() else 0
    if largest < 255:
        return torch.where(index < 0, 255, index).to(torch.uint8), "u8"
    if largest < 32767:
        return index.to(torch.int16), "i16"
    return index.to(torch.int32), "i32"


def _join(buffers: list[memoryview]) -> bytes:
    return b"".join(buffers)
