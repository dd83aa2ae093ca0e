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
from moeswarm.wire.codecs import lossless_codec
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
    """

    layer: int
    hidden: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    mode: str = "exact"
    wire_dispatch: str = "f32"
    wire_combine: str = "f32"

    def to_frame(self, request_id: int) -> Frame:
        index_codec = "i16" if self.top_k_index.numel() == 0 or int(self.top_k_index.max()) < 32767 else "i32"
        descriptors, buffers = wire_tensors.pack(
            [
                ("hidden", self.hidden, self.wire_dispatch),
                ("top_k_index", self.top_k_index.to(torch.int16 if index_codec == "i16" else torch.int32), index_codec),
                ("top_k_weights", self.top_k_weights, lossless_codec(self.top_k_weights.dtype)),
            ]
        )
        meta = {"layer": self.layer, "mode": self.mode, "wire_combine": self.wire_combine, "tensors": descriptors}
        return Frame(Opcode.DISPATCH, request_id, meta, _join(buffers))

    @classmethod
    def from_frame(cls, frame: Frame) -> "Dispatch":
        m = frame.meta
        mode = field(m, "mode", str)
        if mode not in COMBINE_MODES:
            raise ProtocolError(f"unknown combine mode {mode!r} (known: {', '.join(COMBINE_MODES)})")
        descriptors = field(m, "tensors", list)
        tensors = wire_tensors.unpack(descriptors, frame.payload)
        for name in ("hidden", "top_k_index", "top_k_weights"):
            if name not in tensors:
                raise ProtocolError(f"DISPATCH lacks tensor {name!r}")
        hidden, index, weights = tensors["hidden"], tensors["top_k_index"], tensors["top_k_weights"]
        if hidden.dim() != 2 or index.dim() != 2 or index.shape != weights.shape or index.shape[0] != hidden.shape[0]:
            raise ProtocolError(
                f"DISPATCH shapes do not match: hidden {list(hidden.shape)} (want [T, d]), "
                f"top_k_index {list(index.shape)} and top_k_weights {list(weights.shape)} (want [T, k])"
            )
        if index.is_floating_point():
            raise ProtocolError(f"top_k_index must be integers, got {index.dtype}")
        wire_dispatch = next(d["codec"] for d in descriptors if d["name"] == "hidden")
        return cls(field(m, "layer", int), hidden, index.long(), weights, mode, wire_dispatch, field(m, "wire_combine", str))


@dataclass(frozen=True)
class Result:
    """The answer to a DISPATCH.

    exact:   experts [n] ascending, counts [n] rows per expert, outputs [sum(counts), d]: row block i
             is w * E_experts[i](x) for the expert's rows in eager order (slot-major, then token)
    partial: outputs [T, d]: per dispatched token, the weighted sum over this worker's experts
    """

    layer: int
    mode: str
    outputs: torch.Tensor
    experts: list[int]
    counts: list[int]
    wire_combine: str = "f32"

    def to_frame(self, request_id: int) -> Frame:
        descriptors, buffers = wire_tensors.pack([("outputs", self.outputs, self.wire_combine)])
        meta = {"layer": self.layer, "mode": self.mode, "experts": self.experts, "counts": self.counts, "tensors": descriptors}
        return Frame(Opcode.RESULT, request_id, meta, _join(buffers))

    @classmethod
    def from_frame(cls, frame: Frame) -> "Result":
        m = frame.meta
        outputs = wire_tensors.unpack(field(m, "tensors", list), frame.payload).get("outputs")
        if outputs is None or outputs.dim() != 2:
            raise ProtocolError("RESULT must carry a 2-d tensor 'outputs'")
        experts = [int(x) for x in field(m, "experts", list)]
        counts = [int(x) for x in field(m, "counts", list)]
        return cls(field(m, "layer", int), field(m, "mode", str), outputs, experts, counts)


@dataclass(frozen=True)
class ErrorReply:
    code: str
    message: str

    def to_frame(self, request_id: int) -> Frame:
        return Frame(Opcode.ERROR, request_id, {"code": self.code, "message": self.message})

    @classmethod
    def from_frame(cls, frame: Frame) -> "ErrorReply":
        return cls(str(frame.meta.get("code", "error")), str(frame.meta.get("message", "(no message)")))


def _join(buffers: list[memoryview]) -> bytes:
    return b"".join(buffers)
