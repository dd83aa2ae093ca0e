"""A learned lane to quantized experts: a DISPATCH answered from its frame's bytes in one C call.

Why: the worker's own Python around the experts' kernel (the tensors made from the frame, the ids
checked, the module called, the RESULT built) runs at several times its hot-loop time, because the
kernel in between sweeps the caches (docs/measured.md, "express"). This lane does that work in C
(kernels/qkernels.c `qk_dispatch_sums`, `qk_dispatch_rows`): the ids are mapped and checked through
the store's table, the experts run into a new array (partial: each token's sum; exact: each routed
pair's row, experts ascending, slot-major then token), and the RESULT's metadata is the full path's
for the same request.

A `QuantLane` applies to DISPATCHes in float32 to a layer whose experts here are one run of
quantized experts: the C calls are the ones the store's paths make (`_sums`; the pairs' rows through
`qk_experts`), so the bits are the same. A frame whose ids the table refuses goes the full path,
which names what is wrong. One of express's lane kinds (worker/express_answer.py `LearnedLane`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from moeswarm.kernels import qkernels
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Frame, Opcode, pack_meta
from moeswarm.wire.messages import Dispatch
from moeswarm.worker.served import served_span


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

    @property
    def answers_whole(self) -> bool:
        """Whole RESULT frames are made in C (the metadata packs as the C call writes it)."""
        return self.whole is not None

    def in_c(self) -> tuple[tuple, bool] | None:
        """(qkernels.express_lane's struct and what it points into, exact): a held connection answers
        this lane's frames in C."""
        return None if self.whole is None else (self.whole, self.mode == CombineMode.EXACT)

    def answer(self, frame: Frame) -> Frame | None:
        """The RESULT for DISPATCH `frame` in one C call, or None (refused: the full path says why)."""
        payload = np.frombuffer(frame.payload, np.uint8)
        if payload.nbytes != self.payload_bytes:
            return None
        base = payload.__array_interface__["data"][0]
        width = self.plan.hidden
        started = time.thread_time() if self.timed else 0.0
        if self.mode == CombineMode.PARTIAL:
            out = np.zeros((self.tokens, width), np.float32)  # [T, d]: each token's sum
            if qkernels.dispatch_sums(self.plan, base + self.hidden_at, self.tokens, base + self.ids_at,
                                      self.id_bytes, self.k, base + self.weights_at, self.table, out,
                                      self.found[: self.plan.num_experts], torch.get_num_threads()) != 0:
                return None
            if self.served is not None:
                np.add(self.served, self.found[: self.plan.num_experts], out=self.served)  # [n] rows per run expert
            meta = self.meta
        else:
            out = np.zeros((self.tokens * self.k, width), np.float32)  # [T k, d]: the pairs' rows first
            if qkernels.dispatch_rows(self.plan, base + self.hidden_at, self.tokens, base + self.ids_at,
                                      self.id_bytes, self.k, base + self.weights_at, self.table, out, self.found,
                                      torch.get_num_threads()) != 0:
                return None
            n, hit = self.plan.num_experts, int(self.found[-1])
            counts = self.found[n : n + hit].tolist()
            if self.served is not None:
                self.served[self.found[:hit]] += self.found[n : n + hit]  # hit run experts' rows
            out = out[: sum(counts)]  # [S, d]
            meta = {**self.meta, "tensors": [["y", "f32", "f32", [out.shape[0], width]]],
                    "experts": (self.found[:hit] + self.first).tolist(), "counts": counts}
        body = (memoryview(out).cast("B"),)
        if self.timed:
            return Frame(Opcode.RESULT, frame.request_id, {**meta, "cpu_us": int((time.thread_time() - started) * 1e6)},
                         body)
        return Frame(Opcode.RESULT, frame.request_id, meta, body, self.meta_bytes)

    def answer_now(self, body: bytes, request_id: int) -> memoryview | None:
        """The whole RESULT frame answering the DISPATCH whose frame body is `body`, in one C call;
        None where the call declines (the full path then answers it and names any fault)."""
        reply = bytearray(self.reply_bytes)
        size = qkernels.express_answer(self.whole[0], self.mode == CombineMode.EXACT, body, reply, request_id,
                                       torch.get_num_threads())
        return None if size < 0 else memoryview(reply)[:size]


def learn_quant_lane(store, frame: Frame, request: Dispatch, reply: Frame, at: dict) -> QuantLane | bool | None:
    """The QuantLane of `frame`'s metadata (`request` decoded from it, `reply` its RESULT, `at` where its
    tensors lie); None where the layer's experts here are not one run of quantized experts (not this
    kind's), False where they are but the frame's codecs keep it off the lane."""
    express_plan = getattr(store, "express_plan", None)  # a stand-in store (tests) has no C plans
    found = express_plan(request.layer) if express_plan is not None else None
    if found is None:
        return None
    if at["x"][2].name != "f32" or at["w"][2].name != "f32":
        return False
    plan, first = found
    served = served_span(store, request.layer, first, plan.num_experts)
    tokens, k = request.top_k_index.shape
    partial = request.mode == CombineMode.PARTIAL
    meta = {key: value for key, value in reply.meta.items() if key in ("layer", "mode", "tensors") and
            (partial or key != "tensors")}
    table, id_bytes = store.ids_table(request.layer), at["ids"][1] // (tokens * k)
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
                     pack_meta(meta) if partial and not request.timed else None,
                     np.empty(2 * plan.num_experts + 1, np.int64), whole, room, served)
