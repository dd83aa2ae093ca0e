"""A decode step's express call made in C on plain TCP links: the same frames, checks and adds.

Why C: the backbone's Python around a one-token layer call is most of the call's machinery
(docs/measured.md, "lane"). It runs between the holders' kernels, which sweep the shared caches, so
each of its small steps (plan, the DISPATCH's encoding, the send, the reply's frame, the RESULT's
checks, the add) runs from cold memory. A lane call does the same work in two C calls per holder
(transport/token_call.c): `tc_send` writes the holder's DISPATCH from a template the full path
encoded (wire/messages.py `Dispatch.to_frame`) with the token's values in it, `tc_take` reads its
RESULT, compares its metadata with the bytes the full path's decoder accepts for that request
(`Result.to_frame` of the same answer), checks that its values are finite and adds its rows into
the step's output as dispatch/combine.py adds them.

It is the first of a layer call's paths (dispatch/paths.py), `LanePath`: an express call
(dispatch/express_call.py), with the same conditions, plus: the C functions built, one token routed to
distinct experts, every share's link a plain TCP socket with nothing in flight, and holders whose
experts of the token do not interleave (the lowest holder sums its experts, partial mode; the
others' rows follow in expert order: `combine_token`'s adds). Exact mode keeps its bits: the
DISPATCH bytes are the full path's, the RESULT is taken only when its metadata is, and the adds
are the same IEEE single adds in the same order.

Anything else a reply brings is handed back to the express call (`demoted`): a frame read whole
(an ERROR, a RESULT not as expected, an implausible answer) is kept on its link for `wait`, a
header the lane will not read on is left in the link's inbox, and the express call judges and
settles it as it always does. A lost stream (timeout, closed, socket error) closes the link and
ends the call as the express call's failures do.

Legend: d = hidden size, k = router top-k, E = routed experts, n = an exact holder's rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from moeswarm.dispatch import express_call as express, wait
from moeswarm.dispatch.flight import share_request
from moeswarm.dispatch.owners import Owners
from moeswarm.dispatch.paths import Call, CallPath, Gathered, HandedOn, Handle, Outcome
from moeswarm.dispatch.plan import WorkerShare
from moeswarm.dispatch.plausible import NormGate
from moeswarm.dispatch.pool import HolderPool
from moeswarm.errors import WorkerError
from moeswarm.ids import LayerId
from moeswarm.transport import token_call
from moeswarm.transport.link import Pending
from moeswarm.transport.tcp import TcpLink
from moeswarm.transport.token_call import Send, Take
from moeswarm.wire.config import CombineMode, WireConfig
from moeswarm.wire.frames import HEADER, HEADER_SIZE, pack_meta
from moeswarm.wire.messages import Dispatch, Result
from moeswarm.wire.tensors import located

_ONLY_TOKEN = torch.zeros(1, dtype=torch.long)  # [1]: a share's tokens (never written)
_META_ROOM = 4096  # a reply buffer's room for a RESULT's metadata (one token's experts and counts)
_OWNERS_KEPT = 1024  # layers' owner lists kept at once (a model's MoE layers, a few standings' worth)


@dataclass(frozen=True)
class Template:
    """A one-token DISPATCH frame as the full path encodes it, and where the token's values go."""

    frame: bytearray
    address: int
    x_at: int
    ids_at: int
    id_bytes: int
    w_at: int


@dataclass(eq=False)
class LaneShare:
    worker: int
    experts: list[int]  # this holder's experts of the token, ascending
    first: bool  # the token's lowest experts: the holder sums them (partial mode)
    fd: int
    pending: Pending
    deadline: float  # time.monotonic()


@dataclass(eq=False)
class LaneCall:
    wire: WireConfig
    layer: LayerId
    hidden: torch.Tensor  # [1, d]
    top_k_index: torch.Tensor  # [1, k] long
    top_k_weights: torch.Tensor  # [1, k]
    shares: list[LaneShare]  # the lowest experts' holder first, then by expert
    bytes_out: int

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """(holder, DISPATCHes) per share: one each."""
        return [(share.worker, 1) for share in self.shares]


class LanePath:
    """The lane path of a layer call (dispatch/paths.py `CallPath`): the templates, reply buffers and
    owner lists lane calls use; `calls` made whole, `demotions` (calls handed on to express)."""

    name, plans, defers = "lane", False, True

    def __init__(self, pool: HolderPool, owners: Owners, gate: NormGate, wait: wait.WaitPolicy, express: CallPath,
                 flight: CallPath):
        self.pool = pool
        self.owners = owners
        self.gate = gate
        self.wait = wait  # whether a lane call spins for its replies (dispatch/wait.py)
        self.express = express  # the path a call goes on as when a reply is not the lane's
        self.flight = flight  # ... and when it must be made again
        self.calls = 0
        self.demotions = 0
        self._templates: dict[tuple, Template | None] = {}
        self._partial_meta: dict[tuple, bytes] = {}
        self._buffers: dict[int, tuple[object, bytearray, int]] = {}  # holder -> (its link, reply buffer, address)
        # {id(owner tensor): (it, as a list, an int64 copy, its address)}: one per layer's cached owners
        self._owners: dict[int, tuple] = {}
        self._info = np.zeros(3, np.int64)  # the frame tc_take read: opcode, meta_len, body length
        self._top = np.zeros(1, np.float64)  # its largest |value|
        self._info_at, self._top_at = token_call.address(self._info), token_call.address(self._top)
        self._send, self._take = token_call.functions()  # the C functions themselves (None: not built)

    def eligible(self, call: Call) -> bool:
        """The C functions built, an express call's conditions, and a layer known to have no replicas
        (planned before: until then it may have)."""
        return self._send is not None and call.one_token() and not self.owners.replicated(call.layer)

    def send(self, call: Call) -> LaneCall | Outcome:
        """Send the call's DISPATCHes (hidden [1, d] float32, top_k_index [1, k]) to the layer's owners:
        the LaneCall; else Outcome.UNFIT (nothing sent) or Outcome.FAILED (a holder was taken down:
        plan again).

        Written for the few cache lines it touches: plain ints in keys, one pass over the token's k
        experts, the C function called directly (this runs before every decode layer call's send)."""
        wire, layer, hidden, top_k_index, top_k_weights = call.wire, call.layer, call.hidden, call.top_k_index, \
            call.top_k_weights
        if top_k_weights.dtype != torch.float32 or not (
                hidden.is_contiguous() and top_k_index.is_contiguous() and top_k_weights.is_contiguous()):
            return Outcome.UNFIT
        row = top_k_index.tolist()[0]
        owners, owner_at = self._owner_list(self.owners.of(layer))
        if min(row) < 0 or max(row) >= len(owners) or len(set(row)) != len(row):
            return Outcome.UNFIT  # a slot not to plan, or a router that repeats an expert: the full path
        by_holder: dict[int, list[int]] = {}
        for expert in row:
            holder = owners[expert]
            if holder < 0:
                return Outcome.UNFIT
            if holder in by_holder:
                by_holder[holder].append(expert)
            else:
                by_holder[holder] = [expert]
        order = sorted(by_holder, key=lambda h: min(by_holder[h])) if len(by_holder) > 1 else list(by_holder)
        for low, high in zip(order, order[1:]):
            if max(by_holder[low]) > min(by_holder[high]):
                return Outcome.UNFIT  # interleaved experts: only combine_exact's per-expert order is right
        pool, timed = self.pool, wire.timings
        links, states = pool.links, pool.holders
        d, k = hidden.shape[1], len(row)
        plans = []
        for position, holder in enumerate(order):
            link, state = links[holder], states[holder]
            # a TcpLink itself (a relay's too), not a wrapper whose own send and wait would be bypassed
            fd = link.direct_fd() if isinstance(link, TcpLink) and state.up and not state.banned \
                and not state.degraded else None
            experts = sorted(by_holder[holder])
            rows = 1 if position == 0 else len(experts)
            bound = pool.reply_bound(holder)
            if fd is None or bound is not None and rows * d * 4 > bound:
                return Outcome.UNFIT
            id_bytes = 1 if experts[-1] < 255 else 2 if experts[-1] < 32767 else 4  # as Dispatch.to_frame packs them
            key = (layer, position == 0, id_bytes, timed, d, k)
            template = self._templates.get(key, False)
            if template is False:
                template = self._templates[key] = _template(layer, position == 0, id_bytes, timed, d, k)
            if template is None:
                return Outcome.UNFIT
            plans.append((holder, link, state, fd, experts, template, rows))
        x_at, ids_at, w_at = hidden.data_ptr(), top_k_index.data_ptr(), top_k_weights.data_ptr()
        sent = LaneCall(wire, layer, hidden, top_k_index, top_k_weights, [], 0)
        now = time.monotonic()
        for position, (holder, link, state, fd, experts, template, rows) in enumerate(plans):
            request_id = link.new_request_id()
            deadline = now + state.deadline_s(1)
            frame = template.frame
            outcome = self._send(Send(fd, template.address, len(frame), request_id, template.x_at, x_at, d,
                                      template.ids_at, template.id_bytes, ids_at, k, owner_at, len(owners), holder,
                                      template.w_at, w_at, deadline))
            if outcome < 0:
                express.give_up(pool, _express_call(sent), holder, link.lost_directly(outcome, sending=True).cause)
                return Outcome.FAILED
            pending = link.sent_directly(request_id, len(frame), rows * d * 4, time.perf_counter())
            sent.shares.append(LaneShare(holder, experts, position == 0, fd, pending, deadline))
            sent.bytes_out += len(frame)
        self.wait.observe(call.started)  # how this call waits: dispatch/wait.py
        return sent

    def gather(self, handle: Handle, call: LaneCall) -> Gathered | HandedOn:
        """The call's answer; or the express call to go on with (every reply not used here is kept
        on its link); or the flight path where it must be made again (nothing left in flight; a
        holder that failed taken down). Each reply is spun for the wait policy's `spin_s` before the
        wait sleeps; a dozing call sleeps first through most of its first holder's median round
        trip (dispatch/wait.py).

        What can be made before the replies is (the output, the metadata to expect, the learned
        bound): the holders compute meanwhile. After them, only what the answer needs: the
        plausibility of its rows and the links' state. The rest (`record`) waits for the next call's
        send, whose holders then compute."""
        gate, spin_s, doze = self.gate, self.wait.spin_s(), self.wait.dozes
        pool, layer, timed = self.pool, call.layer, call.wire.timings
        d, k = call.hidden.shape[1], call.top_k_index.shape[1]
        metas = [self._partial(layer, d) if share.first else _exact_meta(layer, d, share.experts)
                 for share in call.shares]
        out = torch.zeros(1, d)  # [1, d]: the combined answer
        out_at, info, info_at, top, top_at = out.data_ptr(), self._info, self._info_at, self._top, self._top_at
        bound = gate.learned(layer)  # under it an answer is plausible (None: the full judgement)
        links, taken, answered, peaks, bytes_in = pool.links, [], [], [], 0
        doze_for = _doze(pool, call.shares[0]) if doze else 0.0
        for share, meta in zip(call.shares, metas):
            link = links[share.worker]
            buffer, address = self._buffer(share.worker, link, k, d)
            got = self._take(Take(share.fd, share.pending.request_id, address, len(buffer), meta, len(meta), timed,
                                  1 if share.first else len(share.experts), d, share.first, out_at, share.deadline,
                                  info_at, top_at, doze_for, spin_s))
            doze_for = 0.0  # the others' replies come about when the first's does
            if got >= 0:
                answered.append((share.worker, time.perf_counter() - share.pending.sent_at, got * 1e-6 if timed else None))
                peaks.append(top[0])
                bytes_in += HEADER_SIZE + int(info[2])
                taken.append((share, buffer, int(info[2])))
                continue
            if got in token_call.WHOLE:
                taken.append((share, buffer, int(info[2])))
            elif got in (token_call.OTHER_REQUEST, token_call.TOO_BIG, token_call.BAD_HEADER):
                link.resumed_directly(bytes(buffer[:HEADER_SIZE]))  # the link's own read says what is wrong
            else:
                error = link.lost_directly(got)
                for used, _, _ in taken:  # read here: nothing of theirs is awaited any more
                    links[used.worker].taken_directly(used.pending)
                express.failed(pool, _express_call(call), share.worker, share.deadline, error)
                return HandedOn(self.flight, None)
            return self._demoted(call, taken)
        trusted, plausible = pool.trusted, []
        for (share, _, _), peak in zip(taken, peaks):
            if share.worker in trusted:
                continue
            if bound is not None and peak <= bound:
                plausible.append((layer, float(peak)))  # learned from in `record`
            elif gate.judge(layer, float(peak), lambda share=share: self._rows(share, d), call.hidden) is not None:
                return self._demoted(call, taken)  # the express call judges it again and settles
        for share, _, _ in taken:
            links[share.worker].taken_directly(share.pending)
        self.calls += 1
        return Gathered([], answered, [worker for worker, _, _ in answered], call.bytes_out, bytes_in, 1, out, True,
                        plausible)  # a lane's holders are remote: never trusted, their answers unchecked

    def record(self, answered: Gathered) -> None:
        """A lane call's own bookkeeping: its holders on time, their round trips, the gate's learning."""
        states = self.pool.holders
        for worker, seconds, _ in answered.answered:
            state = states[worker]
            state.on_time()
            state.round_trips.record(seconds, 1)
        for layer, peak in answered.plausible:
            self.gate.learn(layer, peak)

    def _rows(self, share: LaneShare, d: int) -> torch.Tensor:
        """The rows of `share`'s RESULT as read (a copy), [n, d]."""
        buffer, _ = self._buffers[share.worker][1:]
        meta_len = HEADER.unpack_from(buffer)[5]
        rows = 1 if share.first else len(share.experts)
        return torch.from_numpy(np.frombuffer(buffer, np.float32, rows * d, HEADER_SIZE + meta_len).reshape(rows, d).copy())

    def _demoted(self, call: LaneCall, taken: list) -> HandedOn:
        """The express call that goes on from here, the frames read whole kept on their links; the
        flight path where one of them broke its link's stream (a header its link refuses): as `gather`'s."""
        self.demotions += 1
        made = _express_call(call)
        for position, (share, buffer, body) in enumerate(taken):
            try:
                self.pool.links[share.worker].kept_directly(bytes(buffer[: HEADER_SIZE + body]))
            except WorkerError as error:
                for later, _, _ in taken[position + 1 :]:  # read here: nothing of theirs is awaited any more
                    self.pool.links[later.worker].taken_directly(later.pending)
                express.failed(self.pool, made, share.worker, share.deadline, error)
                return HandedOn(self.flight, None)
        return HandedOn(self.express, made)

    def _partial(self, layer: LayerId, d: int) -> bytes:
        key = (layer, d)
        if key not in self._partial_meta:
            self._partial_meta[key] = _result_meta(Result(layer, CombineMode.PARTIAL, torch.zeros(1, d), [], []))
        return self._partial_meta[key]

    def _owner_list(self, owner: torch.Tensor) -> tuple[list[int], int]:
        """owner [E] as a list and the address of its int64 copy, kept per tensor: the dispatcher keeps
        each layer's owners until the holders' standing changes (dispatch/owners.py `of`), so a decode
        step's layers each find theirs (made again every call, it was half the send's cost)."""
        kept = self._owners.get(id(owner))
        if kept is None or kept[0] is not owner:
            if len(self._owners) >= _OWNERS_KEPT:
                self._owners.clear()  # owners of an older standing: the new ones are made again once
            array = np.ascontiguousarray(owner.numpy(), np.int64)
            kept = self._owners[id(owner)] = (owner, array.tolist(), array, token_call.address(array))
        return kept[1], kept[3]

    def _buffer(self, worker: int, link, k: int, d: int) -> tuple[bytearray, int]:
        """The reply buffer of `worker` (kept while its link is the same), room for k rows of d."""
        kept = self._buffers.get(worker)
        need = HEADER_SIZE + _META_ROOM + 4 * k * d
        if kept is None or kept[0] is not link or len(kept[1]) < need:
            buffer = bytearray(need)
            kept = self._buffers[worker] = (link, buffer, token_call.address(buffer))
        return kept[1], kept[2]


def _doze(pool: HolderPool, share: LaneShare) -> float:
    """How long a dozing call sleeps for `share`'s reply now (dispatch/wait.py `doze_s`)."""
    trips = pool.holders[share.worker].round_trips
    median = trips.quantile(0.5, 1) if len(trips) >= pool.policy.min_samples else None
    return wait.doze_s(median, time.perf_counter() - share.pending.sent_at)


def _template(layer: LayerId, first: bool, size: int, timed: bool, d: int, k: int) -> Template | None:
    """The full path's frame for one token (first: the partial one) with ids of `size` bytes, and its
    values' offsets; None where its layout is not the one the C call writes (x, ids, w as f32, the
    ids' codec, f32)."""
    mode = CombineMode.PARTIAL if first else CombineMode.EXACT
    name = {1: "u8", 2: "i16", 4: "i32"}[size]
    ids = torch.full((1, k), {1: 0, 2: 300, 4: 40000}[size], dtype=torch.long)
    frame = Dispatch(layer, torch.zeros(1, d), ids, torch.zeros(1, k), mode, "f32", "f32", timed).to_frame(0)
    data = bytearray(b"".join(bytes(memoryview(part).cast("B")) for part in frame.encode()))
    meta_len = HEADER.unpack_from(data)[5]
    at = located(frame.meta["tensors"])  # {name: (offset, size, codec, dtype, shape)}
    if (at["x"][1] != 4 * d or at["w"][1] != 4 * k or at["ids"][1] != size * k or at["ids"][2].name != name
            or at["x"][2].name != "f32" or at["w"][2].name != "f32"):
        return None
    base = HEADER_SIZE + meta_len
    return Template(data, token_call.address(data), base + at["x"][0], base + at["ids"][0], size, base + at["w"][0])


def _exact_meta(layer: LayerId, d: int, experts: list[int]) -> bytes:
    """The metadata bytes of an exact RESULT with one row per expert, as `Result.to_frame` packs them."""
    return _result_meta(Result(layer, CombineMode.EXACT, torch.zeros(len(experts), d), experts, [1] * len(experts)))


def _result_meta(result: Result) -> bytes:
    """The metadata bytes of `result`'s frame, as the full path packs them (untimed)."""
    return pack_meta(result.to_frame(0).meta)


def _express_call(call: LaneCall) -> express.ExpressCall:
    """`call` as the express call that sent the same requests (its shares and DISPATCHes made now)."""
    made = express.ExpressCall(call.layer, call.hidden, call.top_k_index, call.top_k_weights, bytes_out=call.bytes_out)
    row = call.top_k_index[0].tolist()
    for share in call.shares:
        mine = set(share.experts)
        index = call.top_k_index if len(mine) == len(row) else torch.tensor([[e if e in mine else -1 for e in row]])
        worker_share = WorkerShare(share.worker, _ONLY_TOKEN, index, call.top_k_weights)
        request = share_request(call.wire, call.layer, call.hidden, call.top_k_index, worker_share)
        made.sent.append(express.Sent(worker_share, request, share.worker, share.pending, share.deadline))
    return made
