"""A decode step's DISPATCH answered from its frame's bytes in one C call, without decoding it in Python.

Why: the worker's own Python around the experts' kernel (the tensors made from the frame, the ids
checked, the module called, the RESULT built) runs at several times its hot-loop time, because the
kernel in between sweeps the caches (docs/measured.md, "express"). This lane does that work in C (kernels/qkernels.c
`qk_dispatch_sums`, `qk_dispatch_rows`): the ids are mapped and checked through the store's table,
the experts run into a new array (partial: each token's sum; exact: each routed pair's row, experts
ascending, slot-major then token), and the RESULT's metadata is the full path's for the same request.

A lane is learned from a request the full path answered (worker/compute.py): its metadata bytes
(wire/layouts.py) fix everything the full path checked but the tensors' values, so the next frame
with the same bytes passes the same checks. A `QuantLane` applies to DISPATCHes in float32 to a
layer whose experts here are one run of quantized experts: the C calls are the ones the store's
paths make (`_sums`; the pairs' rows through `qk_experts`), so the bits are the same. A frame whose
ids the table refuses goes the full path, which names what is wrong.

Float experts (a family's own torch modules, the bundled model's) have a lane too, a `TorchLane`:
the store's own `run` on the tensors read from the frame where the layout says (the full path's
decoder, its known-layout branch), and the RESULT the full path encodes; what it skips is the
rest of the full path around them (on the loop: the stream reader's wake-up, the frame's decoding,
the queue and its job; on the thread: the checks its metadata passed before). Where the
experts sum a partial DISPATCH themselves (the store's `self_summing`), a one-token answer on the
loop is one module call on tensors kept per lane, the payload's values copied into them
(`OneCall`), without the Dispatch, its checks and the Result the store's `run` makes around the
same call, each a small step from cold caches.

Express is one of the worker's answerers (worker/answerers.py), after the hold and before the
full path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from msgpack import packb

from moeswarm.kernels import qkernels
from moeswarm.worker.hold import Hold
from moeswarm.worker.store import SelfSumming
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER, HEADER_SIZE, MAGIC, VERSION, Frame, Opcode, pack_meta
from moeswarm.wire.layouts import KnownLayouts
from moeswarm.wire.messages import Dispatch, Result
from moeswarm.wire.tensors import located


@dataclass(frozen=True)
class QuantLane:
    """What a DISPATCH with known metadata bytes to quantized experts needs to be answered in one C call."""

    mode: CombineMode
    plan: qkernels.ExpertsPlan
    first: int  # the run's first expert: the C call's expert i is expert first + i
    table: np.ndarray  # [E + 3] int64: the store's ids table for the layer
    tokens: int
    k: int
    hidden_at: int  # payload offsets of x, ids, w
    ids_at: int
    id_bytes: int
    weights_at: int
    payload_bytes: int
    timed: bool
    meta: dict  # partial: the RESULT's metadata (without cpu_us); exact: its fixed fields
    meta_bytes: bytes | None  # partial, untimed: every RESULT's metadata, packed
    found: np.ndarray  # [2 n + 1] int64 scratch: the C call's hit experts, their counts, how many
    whole: tuple | None = None  # (qkernels.ExpressLane, what it points into): whole RESULT frames in C
    reply_bytes: int = 0  # room a whole RESULT frame needs
    served: np.ndarray | None = None  # [n] int64: the store's counters of the run's experts (worker/served.py)


@dataclass(frozen=True)
class TorchLane:
    """A DISPATCH with known metadata bytes to float experts, answered by the store's own `run`."""

    tokens: int
    payload_bytes: int
    timed: bool
    prefix: bytes | None  # partial: the RESULT's metadata as the full path packs it (timed: up to cpu_us's value)
    sums: OneCall | None = None  # partial, raw float32 and u8 ids, experts that sum themselves


@dataclass(frozen=True)
class OneCall:
    """A TorchLane's answer in one module call (`Express._sums_now`): the store's self-summing experts,
    and the tensors they read, each call's values copied into them from the payload."""

    summing: SelfSumming
    hidden: torch.Tensor  # [T, d] float32
    index: torch.Tensor  # [T, k] int64: the module's ids
    weights: torch.Tensor  # [T, k] float32
    ids: np.ndarray  # [T k] int64: `index`'s memory
    hidden_bytes: memoryview  # `hidden`'s memory
    weights_bytes: memoryview  # `weights`'s memory
    x_at: slice  # where x's, w's and the ids' bytes lie in the payload
    w_at: slice
    ids_at: int
    served: np.ndarray | None = None  # [n] int64: the store's counters of the module's experts (worker/served.py)


class Express:
    """The lanes a worker has learned, and the answers they give: the express answerer
    (worker/answerers.py), whole on the loop (`answer_now`) or as a frame on the compute thread (`answer`)."""

    name = "express"

    def __init__(self, store):
        self.store = store
        self._lanes: KnownLayouts[QuantLane | TorchLane | bool] = KnownLayouts()  # False: metadata seen, no lane for it
        self.answered = 0
        self.whole = 0  # of them, answered with the whole RESULT frame on the loop (`answer_now`)
        self.hold = Hold(self.answer_now)  # the lanes answered whole, for a connection held between them (worker/hold.py)

    def answer(self, frame: Frame, sized: bool = False) -> Frame | None:
        """The RESULT for `frame`, or None: not known here (or refused: the full path says why). Its
        metadata bytes passed every check before, whether `sized` or not."""
        lane = self._lanes.get(frame)
        if not lane:
            return None
        if type(lane) is TorchLane:
            return self._torch(lane, frame)
        payload = np.frombuffer(frame.payload, np.uint8)
        if payload.nbytes != lane.payload_bytes:
            return None
        base = payload.__array_interface__["data"][0]
        width = lane.plan.hidden
        started = time.thread_time() if lane.timed else 0.0
        if lane.mode == CombineMode.PARTIAL:
            out = np.zeros((lane.tokens, width), np.float32)  # [T, d]: each token's sum
            if qkernels.dispatch_sums(lane.plan, base + lane.hidden_at, lane.tokens, base + lane.ids_at,
                                      lane.id_bytes, lane.k, base + lane.weights_at, lane.table, out,
                                      lane.found[: lane.plan.num_experts], torch.get_num_threads()) != 0:
                return None
            if lane.served is not None:
                np.add(lane.served, lane.found[: lane.plan.num_experts], out=lane.served)  # [n] rows per module expert
            meta = lane.meta
        else:
            out = np.zeros((lane.tokens * lane.k, width), np.float32)  # [T k, d]: the pairs' rows first
            if qkernels.dispatch_rows(lane.plan, base + lane.hidden_at, lane.tokens, base + lane.ids_at,
                                      lane.id_bytes, lane.k, base + lane.weights_at, lane.table, out, lane.found,
                                      torch.get_num_threads()) != 0:
                return None
            n, hit = lane.plan.num_experts, int(lane.found[-1])
            counts = lane.found[n : n + hit].tolist()
            if lane.served is not None:
                lane.served[lane.found[:hit]] += lane.found[n : n + hit]  # hit module experts' rows
            out = out[: sum(counts)]  # [S, d]
            meta = {**lane.meta, "tensors": [["y", "f32", "f32", [out.shape[0], width]]],
                    "experts": (lane.found[:hit] + lane.first).tolist(), "counts": counts}
        self.answered += 1
        body = (memoryview(out).cast("B"),)
        if lane.timed:
            return Frame(Opcode.RESULT, frame.request_id, {**meta, "cpu_us": int((time.thread_time() - started) * 1e6)},
                         body)
        return Frame(Opcode.RESULT, frame.request_id, meta, body, lane.meta_bytes)

    def whole_lane(self, body: bytes, meta_len: int) -> QuantLane | TorchLane | None:
        """The lane that answers the DISPATCH whose frame body is `body` (its metadata its first
        `meta_len` bytes) with a whole RESULT frame (`answer_now`: in C, or a TorchLane's), found
        without decoding it."""
        lane = self._lanes.get_bytes(body[:meta_len])
        if not lane or type(lane) is QuantLane and lane.whole is None or len(body) - meta_len != lane.payload_bytes:
            return None
        return lane

    def answer_now(self, lane: QuantLane | TorchLane, body: bytes, request_id: int) -> memoryview | None:
        """The whole RESULT frame (header, metadata, sums) answering the DISPATCH whose frame body is
        `body` (its `whole_lane`), in one C call (a TorchLane: the store's run); None where the call
        declines (the full path then answers it and names any fault)."""
        if type(lane) is TorchLane:
            if lane.sums is not None:
                reply = self._sums_now(lane, body, request_id)
                if reply is not None:
                    return reply
            meta_len = len(body) - lane.payload_bytes
            answered = self._run(lane, Frame(Opcode.DISPATCH, request_id, {}, memoryview(body)[meta_len:],
                                             bytes(body[:meta_len])))
            if answered is None:
                return None
            self.whole += 1
            result, cpu_s = answered
            out = result.outputs  # partial: [T, d]
            if lane.prefix is None or out.dtype != torch.float32 or not out.is_contiguous():
                return memoryview(b"".join(result.to_frame(request_id, cpu_s).encode()))
            return _partial_frame(lane, request_id, out.numpy(), cpu_s)
        reply = bytearray(lane.reply_bytes)
        size = qkernels.express_answer(lane.whole[0], lane.mode == CombineMode.EXACT, body, reply, request_id,
                                       torch.get_num_threads())
        if size < 0:
            return None
        self.answered += 1
        self.whole += 1
        return memoryview(reply)[:size]

    @torch.inference_mode()
    def _sums_now(self, lane: TorchLane, body: bytes, request_id: int) -> memoryview | None:
        """`answer_now` of a partial DISPATCH to experts that sum themselves: the store's one module
        call (`ExpertStore.run`'s `_sums`) on the payload's values, its ids mapped and checked
        through the store's table, and the RESULT frame the full path encodes; None where the ids
        are refused (the full path names why) or the sums are not plain float32. The same call as
        `run`'s on the same values, without the Dispatch, its checks, the tensors' allocation and
        the Result around it: each small step costs several times its hot-loop time here, the
        experts having just swept the caches."""
        one = lane.sums
        payload = memoryview(body)[len(body) - lane.payload_bytes :]
        one.summing.u8_ids.take(np.frombuffer(payload, np.uint8, one.ids.size, one.ids_at), out=one.ids)
        values = one.ids.tolist()
        if -2 in values or values.count(one.summing.other) == len(values):
            return None
        one.hidden_bytes[:] = payload[one.x_at]
        one.weights_bytes[:] = payload[one.w_at]
        started = time.thread_time() if lane.timed else 0.0
        try:
            out = one.summing.module(one.hidden, one.index, one.weights)  # [T, d]
        except Exception:  # noqa: BLE001 - a bug: the full path runs it again and says what it is
            return None
        if out.dtype != torch.float32 or not out.is_contiguous():
            return None
        cpu_s = time.thread_time() - started if lane.timed else None
        if one.served is not None:  # counted once answered (a declined call is counted by the path that answers it)
            for value in values:  # a decode step's few ids: cheaper in Python than a numpy call
                if value >= 0 and value != one.summing.other:
                    one.served[value] += 1
        self.answered += 1
        self.whole += 1
        return _partial_frame(lane, request_id, out.numpy(), cpu_s)

    def learn(self, frame: Frame, request: Dispatch, reply: Frame) -> None:
        """Remember how `frame`'s metadata is answered, where this lane can answer it: `request` is its
        decoded DISPATCH and `reply` the RESULT the full path gave it."""
        if frame.meta_bytes is None or reply.opcode != Opcode.RESULT or self._lanes.get(frame) is not None:
            return  # learned from answers only (an ERROR may be about the values), once per metadata
        lane = self._lane(frame, request, reply)
        self._lanes.remember(frame, lane)
        if type(lane) is QuantLane and lane.whole is not None:
            self.hold.add(frame.meta_bytes, lane.payload_bytes, lane.tokens, lane.reply_bytes, lane.whole,
                          lane.mode == CombineMode.EXACT)
        elif type(lane) is TorchLane:
            self.hold.add(frame.meta_bytes, lane.payload_bytes, lane.tokens, _reply_bound(frame, request), lane=lane)

    def _torch(self, lane: TorchLane, frame: Frame) -> Frame | None:
        """The RESULT the full path gives `frame` (a DISPATCH of `lane`), or None where the store
        refuses it (the full path then names what is wrong)."""
        answered = self._run(lane, frame)
        return None if answered is None else answered[0].to_frame(frame.request_id, answered[1])

    def _run(self, lane: TorchLane, frame: Frame) -> tuple[Result, float | None] | None:
        """(the store's Result for `frame`, its CPU seconds where timed), or None where refused."""
        if len(memoryview(frame.payload)) != lane.payload_bytes:
            return None
        request = Dispatch.from_frame(frame)  # the layout is known: the payload is read where it says
        started = time.thread_time() if lane.timed else 0.0
        try:
            result = self.store.run(request)
        except Exception:  # noqa: BLE001 - refused (or a bug): the full path runs it again and says what it is
            return None
        self.answered += 1
        return result, time.thread_time() - started if lane.timed else None

    def _lane(self, frame: Frame, request: Dispatch, reply: Frame) -> QuantLane | TorchLane | bool:
        express_plan = getattr(self.store, "express_plan", None)  # a stand-in store (tests) has no C plans
        found = express_plan(request.layer) if express_plan is not None else None
        if request.wire_combine != "f32" or request.hidden.dtype != torch.float32 \
                or request.top_k_weights.dtype != torch.float32:
            return False
        at = located(frame.meta["tensors"])  # {name: (offset, size, codec, dtype, shape)}
        if found is None:
            return _torch_lane(self.store, frame, request, reply, at)
        if at["x"][2].name != "f32" or at["w"][2].name != "f32":
            return False
        plan, first = found
        served = _served(self.store, request.layer, first, plan.num_experts)
        tokens, k = request.top_k_index.shape
        partial = request.mode == CombineMode.PARTIAL
        meta = {key: value for key, value in reply.meta.items() if key in ("layer", "mode", "tensors") and
                (partial or key != "tensors")}
        table, id_bytes = self.store.ids_table(request.layer), at["ids"][1] // (tokens * k)
        whole, room = None, 0
        before = len(frame.meta_bytes)  # the tensors' offsets in the frame's body
        timed = {"cpu_us": 0} if request.timed else {}
        if partial:  # the C call writes the RESULT frame too: its metadata as packed here
            packed, tail = pack_meta({**meta, **timed}), b"\xa6cpu_us\x00" if request.timed else b""
            rows = tokens
        else:  # up to its row count, the rest made in C
            packed = pack_meta({**meta, "tensors": [["y", "f32", "f32", [0, 0]]], "experts": [], "counts": [], **timed})
            tail = b"\x00\x00\xa7experts\x90\xa6counts\x90" + (b"\xa6cpu_us\x00" if request.timed else b"")
            rows = tokens * k
        if packed.endswith(tail):
            prefix = packed[: len(packed) - len(tail)] + (b"\xa6cpu_us" if request.timed and partial else b"")
            whole = qkernels.express_lane(plan, tokens, k, id_bytes, before + at["x"][0], before + at["ids"][0],
                                          before + at["w"][0], table, prefix, request.timed, not partial, first,
                                          served)
            room = HEADER_SIZE + len(packed) + 40 + 18 * tokens * k + 4 * rows * plan.hidden
        return QuantLane(request.mode, plan, first, table, tokens, k, at["x"][0], at["ids"][0], id_bytes, at["w"][0],
                    len(memoryview(frame.payload)), request.timed, meta,
                    pack_meta(meta) if partial and not request.timed else None, np.empty(2 * plan.num_experts + 1, np.int64),
                    whole, room, served)


def _torch_lane(store, frame: Frame, request: Dispatch, reply: Frame, at: dict) -> TorchLane:
    """The TorchLane of `frame`'s metadata (`request` decoded from it, `reply` its RESULT, `at` where
    its tensors lie), with the one-call answer (`Express._sums_now`) where the request is partial,
    its tensors travel raw (float32, ids as u8) and the store's experts for its layer sum themselves."""
    (tokens, k), payload_bytes = request.top_k_index.shape, len(memoryview(frame.payload))
    if request.mode != CombineMode.PARTIAL:
        return TorchLane(tokens, payload_bytes, request.timed, None)
    prefix = _partial_prefix(reply.meta, request.timed)
    self_summing = getattr(store, "self_summing", None)  # a stand-in store (tests) has none
    summing = self_summing(request.layer) if self_summing is not None else None
    if prefix is None or summing is None or [at[name][2].name for name in ("x", "ids", "w")] != ["f32", "u8", "f32"]:
        return TorchLane(tokens, payload_bytes, request.timed, prefix)
    hidden, weights = torch.empty(request.hidden.shape), torch.empty(tokens, k)  # [T, d], [T, k] float32
    index = torch.empty(tokens, k, dtype=torch.int64)
    (x_at, x_size, *_), (w_at, w_size, *_) = at["x"], at["w"]
    sums = OneCall(summing, hidden, index, weights, index.numpy().reshape(-1), memoryview(hidden.numpy()).cast("B"),
                   memoryview(weights.numpy()).cast("B"), slice(x_at, x_at + x_size), slice(w_at, w_at + w_size),
                   at["ids"][0], _served(store, request.layer, summing.first, _module_experts(store, request.layer)))
    return TorchLane(tokens, payload_bytes, request.timed, prefix, sums)


def _served(store, layer: int, first: int, count: int) -> np.ndarray | None:
    """The store's counters [count] of experts first.. of `layer` (worker/served.py), or None (a stand-in store)."""
    served = getattr(store, "served", None)
    return None if served is None else served.span(layer, first, count)


def _module_experts(store, layer: int) -> int:
    """How many experts the layer's one module holds here (its ids within the module are 0..n-1)."""
    held = getattr(store, "held", {}).get(layer, ())
    return len(held)


def _reply_bound(frame: Frame, request: Dispatch) -> int:
    """The largest RESULT frame a DISPATCH with `frame`'s metadata (`request` decoded) may get from the
    full path: each routed pair's row (exact), the metadata, its experts and counts."""
    (tokens, k), hidden = request.top_k_index.shape, request.hidden.shape[1]
    return HEADER_SIZE + len(frame.meta_bytes) + 256 + 18 * tokens * k + 4 * tokens * k * hidden


def _partial_frame(lane: TorchLane, request_id: int, rows: np.ndarray, cpu_s: float | None) -> memoryview:
    """The whole partial RESULT frame of a TorchLane's answer, rows [T, d] float32: its metadata
    as Result.to_frame packs it (`lane.prefix`, then cpu_us's value where timed), then the rows."""
    meta = lane.prefix + (packb(int(cpu_s * 1e6)) if lane.timed else b"")
    header = HEADER.pack(MAGIC, VERSION, Opcode.RESULT, 0, request_id, len(meta), rows.nbytes)
    return memoryview(b"".join((header, meta, rows)))


def _partial_prefix(meta: dict, timed: bool) -> bytes | None:
    """A partial RESULT's metadata (`meta`, as the full path made it) packed as Result.to_frame packs
    it, up to its cpu_us value when `timed` (msgpack's encoding of that integer follows)."""
    fields = {key: value for key, value in meta.items() if key != "cpu_us"}
    if not timed:
        return pack_meta(fields)
    packed = pack_meta({**fields, "cpu_us": 0})
    return packed[:-1] if packed.endswith(b"\xa6cpu_us\x00") else None
