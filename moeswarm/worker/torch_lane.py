"""A learned lane to float experts (a family's own torch modules, the bundled model's): a DISPATCH
answered by the store's own `run` on the tensors read from the frame where the layout says.

The tensors are read by the full path's decoder (its known-layout branch) and the RESULT is the one
the full path encodes; what the lane skips is the rest of the full path around them (on the loop:
the stream reader's wake-up, the frame's decoding, the queue and its job; on the thread: the checks
its metadata passed before). Where the experts sum a partial DISPATCH themselves (the store's
`self_summing`), a one-token answer on the loop is one module call on tensors kept per lane, the
payload's values copied into them (`OneCall`), without the Dispatch, its checks and the Result the
store's `run` makes around the same call, each a small step from cold caches.

One of express's lane kinds (worker/express_answer.py `LearnedLane`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from msgpack import packb

from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER, HEADER_SIZE, MAGIC, VERSION, Frame, Opcode, pack_meta
from moeswarm.wire.messages import Dispatch, Result
from moeswarm.worker.served import served_span
from moeswarm.worker.store import SelfSumming

if TYPE_CHECKING:
    from moeswarm.worker.store import ExpertStore


@dataclass(frozen=True)
class OneCall:
    """A TorchLane's answer in one module call (`TorchLane._sums_now`): the store's self-summing experts,
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


@dataclass(frozen=True)
class TorchLane:
    """A DISPATCH with known metadata bytes to float experts, answered by the store's own `run`."""

    store: ExpertStore
    tokens: int
    payload_bytes: int
    reply_bytes: int  # the largest RESULT frame the full path may give such a DISPATCH
    timed: bool
    prefix: bytes | None  # partial: the RESULT's metadata as the full path packs it (timed: up to cpu_us's value)
    sums: OneCall | None = None  # partial, raw float32 and u8 ids, experts that sum themselves

    answers_whole: ClassVar[bool] = True  # every answer can be a whole RESULT frame (`answer_now`)

    def in_c(self) -> None:
        """None: a held connection answers this lane's frames by `answer_now` (a torch module's)."""
        return None

    def answer(self, frame: Frame) -> Frame | None:
        """The RESULT the full path gives DISPATCH `frame`, or None where the store refuses it (the full
        path then names what is wrong)."""
        answered = self._run(frame)
        return None if answered is None else answered[0].to_frame(frame.request_id, answered[1])

    def answer_now(self, body: bytes, request_id: int) -> memoryview | None:
        """The whole RESULT frame answering the DISPATCH whose frame body is `body`: one module call
        (`_sums_now`) where it may, else the store's run; None where refused."""
        if self.sums is not None:
            reply = self._sums_now(body, request_id)
            if reply is not None:
                return reply
        meta_len = len(body) - self.payload_bytes
        answered = self._run(Frame(Opcode.DISPATCH, request_id, {}, memoryview(body)[meta_len:], bytes(body[:meta_len])))
        if answered is None:
            return None
        result, cpu_s = answered
        out = result.outputs  # partial: [T, d]
        if self.prefix is None or out.dtype != torch.float32 or not out.is_contiguous():
            return memoryview(b"".join(result.to_frame(request_id, cpu_s).encode()))
        return _partial_frame(self, request_id, out.numpy(), cpu_s)

    @torch.inference_mode()
    def _sums_now(self, body: bytes, request_id: int) -> memoryview | None:
        """`answer_now` of a partial DISPATCH to experts that sum themselves: the store's one module
        call (`ExpertStore.run`'s `_sums`) on the payload's values, its ids mapped and checked
        through the store's table, and the RESULT frame the full path encodes; None where the ids
        are refused (the full path names why) or the sums are not plain float32. The same call as
        `run`'s on the same values, without the Dispatch, its checks, the tensors' allocation and
        the Result around it: each small step costs several times its hot-loop time here, the
        experts having just swept the caches."""
        one = self.sums
        payload = memoryview(body)[len(body) - self.payload_bytes :]
        one.summing.u8_ids.take(np.frombuffer(payload, np.uint8, one.ids.size, one.ids_at), out=one.ids)
        values = one.ids.tolist()
        if -2 in values or values.count(one.summing.other) == len(values):
            return None
        one.hidden_bytes[:] = payload[one.x_at]
        one.weights_bytes[:] = payload[one.w_at]
        started = time.thread_time() if self.timed else 0.0
        try:
            out = one.summing.module(one.hidden, one.index, one.weights)  # [T, d]
        except Exception:  # noqa: BLE001 - a bug: the full path runs it again and says what it is
            return None
        if out.dtype != torch.float32 or not out.is_contiguous():
            return None
        cpu_s = time.thread_time() - started if self.timed else None
        if one.served is not None:  # counted once answered (a declined call is counted by the path that answers it)
            for value in values:  # a decode step's few ids: cheaper in Python than a numpy call
                if value >= 0 and value != one.summing.other:
                    one.served[value] += 1
        return _partial_frame(self, request_id, out.numpy(), cpu_s)

    def _run(self, frame: Frame) -> tuple[Result, float | None] | None:
        """(the store's Result for `frame`, its CPU seconds where timed), or None where refused."""
        if len(memoryview(frame.payload)) != self.payload_bytes:
            return None
        request = Dispatch.from_frame(frame)  # the layout is known: the payload is read where it says
        started = time.thread_time() if self.timed else 0.0
        try:
            result = self.store.run(request)
        except Exception:  # noqa: BLE001 - refused (or a bug): the full path runs it again and says what it is
            return None
        return result, time.thread_time() - started if self.timed else None


def learn_torch_lane(store, frame: Frame, request: Dispatch, reply: Frame, at: dict) -> TorchLane:
    """The TorchLane of `frame`'s metadata (`request` decoded from it, `reply` its RESULT, `at` where
    its tensors lie), with the one-call answer (`TorchLane._sums_now`) where the request is partial,
    its tensors travel raw (float32, ids as u8) and the store's experts for its layer sum themselves.
    Any store's experts answer through its `run`: this kind takes what the kinds before it leave."""
    (tokens, k), payload_bytes = request.top_k_index.shape, len(memoryview(frame.payload))
    reply_bytes = _reply_bound(frame, request)
    if request.mode != CombineMode.PARTIAL:
        return TorchLane(store, tokens, payload_bytes, reply_bytes, request.timed, None)
    prefix = _partial_prefix(reply.meta, request.timed)
    self_summing = getattr(store, "self_summing", None)  # a stand-in store (tests) has none
    summing = self_summing(request.layer) if self_summing is not None else None
    if prefix is None or summing is None or [at[name][2].name for name in ("x", "ids", "w")] != ["f32", "u8", "f32"]:
        return TorchLane(store, tokens, payload_bytes, reply_bytes, request.timed, prefix)
    hidden, weights = torch.empty(request.hidden.shape), torch.empty(tokens, k)  # [T, d], [T, k] float32
    index = torch.empty(tokens, k, dtype=torch.int64)
    (x_at, x_size, *_), (w_at, w_size, *_) = at["x"], at["w"]
    sums = OneCall(summing, hidden, index, weights, index.numpy().reshape(-1), memoryview(hidden.numpy()).cast("B"),
                   memoryview(weights.numpy()).cast("B"), slice(x_at, x_at + x_size), slice(w_at, w_at + w_size),
                   at["ids"][0], served_span(store, request.layer, summing.first, _module_experts(store, request.layer)))
    return TorchLane(store, tokens, payload_bytes, reply_bytes, request.timed, prefix, sums)


def _module_experts(store, layer: int) -> int:
    """How many experts the layer's one module holds here (its ids within the module are 0..n-1)."""
    return len(getattr(store, "held", {}).get(layer, ()))


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
