"""Typed messages of protocol v2 and their frames.

HELLO      backbone -> worker: {"fingerprint", "role"}; worker -> backbone: WorkerInfo
DISPATCH   backbone -> worker: one MoE layer, all tokens of the step routed to this worker
RESULT     worker -> backbone: the experts' outputs for a DISPATCH
ERROR      either way: {"code", "message"}; the connection stays usable unless framing broke
PING/PONG  liveness, empty metadata
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeswarm.errors import ProtocolError
from moeswarm.wire import tensors as wire_tensors
from moeswarm.wire.codecs import FLOAT_CODECS, INTEGER_CODECS, get_codec, lossless_codec
from moeswarm.wire.config import COMBINE_MODES, CombineMode
from moeswarm.wire.frames import VERSION, Frame, Opcode
from moeswarm.wire.layouts import KnownLayouts, TensorAt

PROTOCOL_VERSION = VERSION
MAX_LAYERS = 1 << 12  # far above any model's MoE layers: a bound on what a HELLO may list
MAX_EXPERTS = 1 << 16
MAX_CPU_US = 1 << 40  # a RESULT's `cpu_us`: any real call is far below
U8_IDS = np.arange(256, dtype=np.int64)  # a u8 expert id on the wire -> its id (255: -1, another worker's)
U8_IDS[255] = -1


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
    """What a worker serves: its answer to HELLO.

    held: {MoE layer: experts held in that layer, ascending}. Any set per layer, not only
    ranges; on the wire a list of [layer, [experts...]] pairs (msgpack map keys must be strings).
    max_result_bytes: the largest RESULT the worker sends (its --max-unsent-bytes): a DISPATCH
    whose RESULT would be larger is refused, so the backbone splits it. Optional on the wire
    (absent from older workers, and from a link in the backbone's own process: None).
    """

    fingerprint: str
    model_type: str
    num_experts: int
    hidden_size: int
    held: dict[int, tuple[int, ...]]
    codecs: tuple[str, ...]
    max_result_bytes: int | None = None

    def to_frame(self, request_id: int) -> Frame:
        meta = {
            "protocol": PROTOCOL_VERSION, "fingerprint": self.fingerprint, "model_type": self.model_type,
            "num_experts": self.num_experts, "hidden_size": self.hidden_size,
            "held": [[layer, list(experts)] for layer, experts in sorted(self.held.items())],
            "codecs": list(self.codecs),
        }
        if self.max_result_bytes is not None:
            meta["max_result_bytes"] = self.max_result_bytes
        return Frame(Opcode.HELLO, request_id, meta)

    @classmethod
    def from_frame(cls, frame: Frame) -> "WorkerInfo":
        m = frame.meta
        num_experts = field(m, "num_experts", int)
        hidden_size = field(m, "hidden_size", int)
        if not 0 < num_experts <= MAX_EXPERTS or hidden_size <= 0:
            raise ProtocolError(f"HELLO announces {num_experts} experts of hidden size {hidden_size}")
        pairs = field(m, "held", list)
        if len(pairs) > MAX_LAYERS:
            raise ProtocolError(f"HELLO lists {len(pairs)} layers, over the limit of {MAX_LAYERS}")
        held: dict[int, tuple[int, ...]] = {}
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0]) and isinstance(pair[1], list)):
                raise ProtocolError(f"HELLO 'held' entries must be [layer, [experts...]], got {pair!r:.80}")
            layer, experts = pair
            if not 0 <= layer < MAX_LAYERS or layer in held:
                raise ProtocolError(f"HELLO lists layer {layer} twice or out of range")
            if not experts or not all(_is_int(e) and 0 <= e < num_experts for e in experts) or experts != sorted(set(experts)):
                raise ProtocolError(f"HELLO layer {layer}: experts must be distinct ascending ids in 0-{num_experts - 1}, "
                                    f"got {experts!r:.80}")
            held[layer] = tuple(experts)
        codecs = field(m, "codecs", list)
        bound = m.get("max_result_bytes")
        if bound is not None and not (_is_int(bound) and bound > 0):
            raise ProtocolError(f"HELLO 'max_result_bytes' must be a positive integer, got {bound!r:.40}")
        return cls(field(m, "fingerprint", str), field(m, "model_type", str), num_experts, hidden_size, held,
                   tuple(str(c) for c in codecs), bound)


@dataclass(frozen=True)
class _DispatchLayout:
    """A DISPATCH's metadata, checked: what `Dispatch.from_frame` needs to decode the next frame
    with the same metadata bytes."""

    layer: int
    mode: CombineMode
    wire_dispatch: str
    wire_combine: str
    timed: bool
    x: TensorAt
    ids: TensorAt
    w: TensorAt
    u8: bool  # ids travel as u8 (255: -1)
    payload_bytes: int


_DISPATCHES: KnownLayouts[_DispatchLayout] = KnownLayouts()


@dataclass(frozen=True)
class Dispatch:
    """One MoE layer's work for one worker.

    hidden         [T, d] hidden states of the tokens that use at least one of this worker's experts
    top_k_index    [T, k] int, the router's choices; -1 where the expert lives on another worker
    top_k_weights  [T, k] the router's weights, same dtype as the model's

    On the wire the tensors are named x, ids and w (short names: metadata bytes count on a reduced
    decode step). ids travel as u8 (ids < 255, with 255 for -1), else i16 or i32. timed (field `t`,
    sent only when true): the RESULT must say its experts' CPU time (`Result.cpu_s`).
    """

    layer: int
    hidden: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    mode: CombineMode = CombineMode.EXACT
    wire_dispatch: str = "f32"
    wire_combine: str = "f32"
    timed: bool = False

    def to_frame(self, request_id: int) -> Frame:
        descriptors, buffers = wire_tensors.pack(
            [
                ("x", self.hidden, self.wire_dispatch),
                ("ids", *_compact_ids(self.top_k_index)),
                ("w", self.top_k_weights, lossless_codec(self.top_k_weights.dtype)),
            ]
        )
        meta = {"layer": self.layer, "mode": CombineMode(self.mode).value, "combine": self.wire_combine, "tensors": descriptors}
        if self.timed:
            meta["t"] = True
        return Frame(Opcode.DISPATCH, request_id, meta, tuple(buffers))

    @classmethod
    def from_frame(cls, frame: Frame) -> "Dispatch":
        """The DISPATCH in `frame`; ProtocolError names what is wrong. Metadata bytes found sound
        before are not checked again (wire/layouts.py): only the payload's length is."""
        layout = _DISPATCHES.get(frame)
        payload = memoryview(frame.payload)
        if layout is None or len(payload) != layout.payload_bytes:
            request, layout = cls._checked(frame)
            _DISPATCHES.remember(frame, layout)
            return request
        ids = layout.ids.array(payload)  # [T, k] in the wire's integer dtype
        index = torch.from_numpy(U8_IDS.take(ids) if layout.u8 else ids.astype(np.int64))
        return cls(layout.layer, layout.x.tensor(payload), index, layout.w.tensor(payload), layout.mode,
                   layout.wire_dispatch, layout.wire_combine, layout.timed)

    @classmethod
    def _checked(cls, frame: Frame) -> tuple["Dispatch", "_DispatchLayout"]:
        """The DISPATCH with every check of its metadata, and the layout those checks found sound."""
        m = frame.meta
        mode = field(m, "mode", str)
        if mode not in COMBINE_MODES:
            raise ProtocolError(f"unknown combine mode {mode!r} (known: {', '.join(COMBINE_MODES)})")
        mode = CombineMode(mode)
        descriptors = field(m, "tensors", list)
        tensors = wire_tensors.unpack(descriptors, frame.payload, raw="ids")  # ids: a numpy view of their bytes
        for name in ("x", "ids", "w"):
            if name not in tensors:
                raise ProtocolError(f"DISPATCH lacks tensor {name!r}")
        hidden, index, weights = tensors["x"], tensors["ids"], tensors["w"]
        if hidden.dim() != 2 or index.ndim != 2 or index.shape != weights.shape or index.shape[0] != hidden.shape[0]:
            raise ProtocolError(
                f"DISPATCH shapes do not match: x {list(hidden.shape)} (want [T, d]), "
                f"ids {list(index.shape)} and w {list(weights.shape)} (want [T, k])"
            )
        codec_of = {d[0]: d[1] for d in descriptors}
        dtype_of = {d[0]: d[2] for d in descriptors}
        if codec_of["ids"] not in INTEGER_CODECS or dtype_of["ids"] != codec_of["ids"]:
            raise ProtocolError(f"expert ids must be integers in their own codec (u8, i16, i32 or i64), "
                                f"got dtype {dtype_of['ids']!r} in codec {codec_of['ids']!r}")
        # [T, k] int64, a new array: the bookkeeping runs in numpy (a few us where torch's takes ~10)
        ids = U8_IDS.take(index) if codec_of["ids"] == "u8" else index.astype(np.int64)
        index = torch.from_numpy(ids)
        wire_dispatch = codec_of["x"]
        for name in ("x", "w"):
            if codec_of[name] not in FLOAT_CODECS:
                raise ProtocolError(f"DISPATCH tensor {name!r} must travel in a float codec, got {codec_of[name]!r}")
        combine = field(m, "combine", str)
        get_codec(combine)  # an unknown combine codec is refused now, not after the experts ran
        if combine not in FLOAT_CODECS:
            raise ProtocolError(f"combine codec {combine!r} cannot carry the experts' outputs "
                                f"(choose from {', '.join(FLOAT_CODECS)})")
        timed = m.get("t", False)
        if type(timed) is not bool:
            raise ProtocolError(f"DISPATCH field 't' must be true or false, got {timed!r:.40}")
        request = cls(field(m, "layer", int), hidden, index, weights, mode, wire_dispatch, combine, timed)
        at = {name: TensorAt(*where) for name, where in wire_tensors.located(descriptors).items()}
        return request, _DispatchLayout(request.layer, mode, wire_dispatch, combine, timed, at["x"], at["ids"], at["w"],
                                        codec_of["ids"] == "u8", len(memoryview(frame.payload)))


@dataclass(frozen=True)
class _ResultLayout:
    """A partial RESULT's metadata, checked: what `Result.from_frame` needs to decode the next frame
    with the same metadata bytes."""

    layer: int
    y: TensorAt
    cpu_s: float | None
    payload_bytes: int


_RESULTS: KnownLayouts[_ResultLayout] = KnownLayouts()


@dataclass(frozen=True)
class Result:
    """The answer to a DISPATCH.

    exact:   experts [n] ascending, counts [n] rows per expert, outputs [sum(counts), d]: row block i
             is w * E_experts[i](x) for the expert's rows in eager order (slot-major, then token)
    partial: outputs [T, d]: per dispatched token, the weighted sum over this worker's experts
             (experts and counts are not sent)

    On the wire the outputs tensor is named y. cpu_s: the CPU seconds the worker's experts took for
    it (field `cpu_us`, sent when the DISPATCH asked: where a call's time goes, network or experts);
    None when not said.
    """

    layer: int
    mode: CombineMode
    outputs: torch.Tensor
    experts: list[int]
    counts: list[int]
    wire_combine: str = "f32"
    cpu_s: float | None = None

    def to_frame(self, request_id: int, cpu_s: float | None = None) -> Frame:
        """cpu_s: the experts' CPU seconds to say (None: this Result's own)."""
        descriptors, buffers = wire_tensors.pack([("y", self.outputs, self.wire_combine)])
        meta = {"layer": self.layer, "mode": CombineMode(self.mode).value, "tensors": descriptors}
        if self.mode == CombineMode.EXACT:
            meta.update(experts=self.experts, counts=self.counts)
        cpu_s = self.cpu_s if cpu_s is None else cpu_s
        if cpu_s is not None:
            meta["cpu_us"] = int(cpu_s * 1e6)
        return Frame(Opcode.RESULT, request_id, meta, tuple(buffers))

    @classmethod
    def from_frame(cls, frame: Frame) -> "Result":
        """The RESULT in `frame`; ProtocolError names what is wrong. A partial RESULT's metadata bytes
        found sound before are not checked again (wire/layouts.py): only the payload's length is."""
        layout = _RESULTS.get(frame)
        payload = memoryview(frame.payload)
        if layout is not None and len(payload) == layout.payload_bytes:
            return cls(layout.layer, CombineMode.PARTIAL, layout.y.tensor(payload), [], [], cpu_s=layout.cpu_s)
        result = cls._checked(frame)
        if result.mode == CombineMode.PARTIAL:  # an exact RESULT's metadata names its experts: it seldom repeats
            y = TensorAt(*wire_tensors.located(frame.meta["tensors"])["y"])
            _RESULTS.remember(frame, _ResultLayout(result.layer, y, result.cpu_s, len(payload)))
        return result

    @classmethod
    def _checked(cls, frame: Frame) -> "Result":
        m = frame.meta
        outputs = wire_tensors.unpack(field(m, "tensors", list), frame.payload).get("y")
        if outputs is None or outputs.dim() != 2:
            raise ProtocolError("RESULT must carry a 2-d tensor 'y'")
        mode = field(m, "mode", str)
        if mode not in COMBINE_MODES:
            raise ProtocolError(f"RESULT has unknown combine mode {mode!r}")
        if mode == CombineMode.EXACT:
            experts, counts = field(m, "experts", list), field(m, "counts", list)
            if not all(_is_int(x) for x in experts + counts):
                raise ProtocolError("RESULT 'experts' and 'counts' must be integers")
        else:
            experts, counts = [], []
        cpu_us = m.get("cpu_us")
        if cpu_us is not None and not (_is_int(cpu_us) and 0 <= cpu_us <= MAX_CPU_US):
            raise ProtocolError(f"RESULT 'cpu_us' must be an integer in 0-{MAX_CPU_US}, got {cpu_us!r:.40}")
        return cls(field(m, "layer", int), CombineMode(mode), outputs, experts, counts,
                   cpu_s=None if cpu_us is None else cpu_us / 1e6)


@dataclass(frozen=True)
class ErrorReply:
    code: str
    message: str

    def to_frame(self, request_id: int) -> Frame:
        return Frame(Opcode.ERROR, request_id, {"code": self.code, "message": self.message})

    @classmethod
    def from_frame(cls, frame: Frame) -> "ErrorReply":
        return cls(str(frame.meta.get("code", "error")), str(frame.meta.get("message", "(no message)")))


def _compact_ids(index: torch.Tensor) -> tuple[np.ndarray, str]:
    """Expert ids in the smallest integer codec that holds them (u8 maps -1 to 255), as numpy."""
    ids = index.numpy()
    if not ids.size:
        return ids.astype(np.uint8), "u8"
    largest = int(ids.max())
    if largest < 255:
        if int(ids.min()) >= -1:
            return ids.astype(np.uint8), "u8"  # the cast wraps -1 to 255: one numpy call, not three
        return np.where(ids < 0, 255, ids).astype(np.uint8), "u8"
    if largest < 32767:
        return ids.astype(np.int16), "i16"
    return ids.astype(np.int32), "i32"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
