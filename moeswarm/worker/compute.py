"""A DISPATCH on the compute thread: decode it, run the experts, encode the RESULT (or the ERROR).

Everything here runs on the compute runner's thread (worker/runner.py), one call at a time: the
store is never entered twice at once. Every request gets a reply frame from here, never an
exception: "bad_request" for what the protocol or this worker refuses, "internal" for a bug on
this side (logged with its traceback; the worker goes on serving).

`one` asks the worker's answerers in turn (worker/answerers.py, which makes the chain with this
answerer last): a DISPATCH whose metadata bytes were answered before goes express when it can
(worker/express_answer.py: the same bits from the frame's bytes), every other one the full path
(`answer`), which teaches express its lane.
DISPATCHes of one layer from several connections may run as one expert call (`batch`,
worker/merge.py decides which may merge and keeps the bits); each is answered exactly as `one`
would have answered it alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from moeswarm.errors import MoeSwarmError, printable
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import Frame
from moeswarm.wire.messages import Dispatch, ErrorReply, Result
from moeswarm.worker.answerers import answerers
from moeswarm.worker.limits import WorkerLimits, check_dispatch_size, check_reply_size
from moeswarm.worker.merge import merge, partners, split
from moeswarm.worker.replies import check_reply_bytes
from moeswarm.worker.runner import DECLINED

if TYPE_CHECKING:
    from moeswarm.worker.answerers import LoopSide
    from moeswarm.worker.session import Session
    from moeswarm.worker.store import ExpertStore

log = logging.getLogger("moeswarm.worker")


class Computation:
    """DISPATCH frames in, RESULT or ERROR frames out, with `store`'s experts under `limits`: the compute
    answerer (worker/answerers.py), last in the chain it walks (`one`).

    model_top_k: the model's router top-k: no DISPATCH may ask for more (None: only the limit's).
    """

    name = "compute"

    def __init__(self, store: ExpertStore, limits: WorkerLimits, model_top_k: int | None = None):
        self.store = store
        self.limits = limits
        self.model_top_k = model_top_k
        self.merged_calls = 0  # expert calls that served several connections' DISPATCHes at once
        self.merged_requests = 0  # the DISPATCHes they served
        # the worker's answerers, this one last; express: metadata seen before, answered from the frame's bytes
        self.answerers, self.express = answerers(store, self)

    def one(self, frame: Frame, sized: bool = False) -> Frame:
        """The reply to one DISPATCH frame, from the first answerer of the chain that answers it.

        sized: the frame's declared sizes were checked against the limits already (on the event
        loop, before it was queued: worker/requests.py)."""
        return self.answerers.one(frame, sized)

    def answer_on_loop(self, loop: LoopSide, session: Session, request_id: int, meta_len: int, body: bytes,
                       feed: Callable[[bytes], None] | None) -> bool:
        """False: the full path runs as the runner's work, once the frame is decoded and queued
        (worker/requests.py), never as an answer on the loop."""
        return False

    def answer(self, frame: Frame, sized: bool = False) -> Frame:
        """The full path's reply to one DISPATCH frame: decoding, experts and encoding (express learns
        the frame's lane from it)."""
        decoded = self._decode(frame, sized=sized)
        if isinstance(decoded, Frame):
            return decoded
        reply = self._answer(frame.request_id, *decoded, self.store.run, timed=decoded[0].timed)
        self.express.learn(frame, decoded[0], reply)
        return reply

    def batch(self, frames: list[Frame]) -> list[Frame | object]:
        """The runner's batch_work: frames[0]'s DISPATCH and those of other connections that may run
        in one expert call with it (same layer and mode, disjoint experts), each answered exactly as
        `one` would have; DECLINED for the others (they wait their turn)."""
        lead = self._decode(frames[0], sized=True)  # every frame the runner holds passed check_dispatch_size
        if isinstance(lead, Frame):
            return [lead] + [DECLINED] * (len(frames) - 1)
        requests = [(0, lead)]
        for position, frame in enumerate(frames[1:], 1):
            decoded = self._decode(frame, quiet=True, sized=True)
            if not isinstance(decoded, Frame):  # a bad one is declined: it gets its ERROR in its turn
                requests.append((position, decoded))
        chosen = [requests[i] for i in partners([request for _, (request, _) in requests])]
        replies: list[Frame | object] = [DECLINED] * len(frames)
        results = self._merged([request for _, (request, _) in chosen]) if len(chosen) > 1 else None
        if results is None:
            replies[0] = self._answer(frames[0].request_id, *lead, self.store.run, timed=lead[0].timed)
            return replies
        for (position, decoded), result in zip(chosen, results):
            replies[position] = self._answer(frames[position].request_id, *decoded, lambda _request, r=result: r)
        return replies

    def _merged(self, requests: list[Dispatch]) -> list[Result] | None:
        """Each request's Result from one expert call; None when the merged call is refused (one of
        them asks for what this worker does not serve): then the lead runs alone, the others in their turn."""
        merged, plan = merge(requests)
        try:
            results = split(self.store.run(merged), plan)
        except MoeSwarmError:
            return None
        self.merged_calls += 1
        self.merged_requests += len(requests)
        return results

    def _decode(self, frame: Frame, quiet: bool = False, sized: bool = False) -> tuple[Dispatch, int] | Frame:
        """(the DISPATCH in `frame`, its routed pairs S), or the ERROR frame that answers it (not logged
        when `quiet`)."""
        try:
            if not sized:
                check_dispatch_size(frame.meta, self.limits, model_top_k=self.model_top_k)
            request = Dispatch.from_frame(frame)
            return request, check_reply_bytes(request, self.store.hidden_size, self.store.num_experts,
                                              self.limits.max_unsent_bytes)
        except MoeSwarmError as error:
            if not quiet:
                log.info("request %d refused: %s", frame.request_id, printable(str(error)))
            return ErrorReply("bad_request", str(error)).to_frame(frame.request_id)
        except Exception as error:  # a bug on our side: report it and keep serving
            log.exception("request %d failed", frame.request_id)
            return ErrorReply("internal", printable(f"{type(error).__name__}: {error}")).to_frame(frame.request_id)

    def _answer(self, rid: int, request: Dispatch, routed: int, run: Callable[[Dispatch], Result],
                timed: bool = False) -> Frame:
        """RESULT (or ERROR) frame for `request` (`routed`: its S), whose Result `run` gives; `timed`:
        the request asked, and `run` computes it alone here: the RESULT says the CPU time it took on
        this thread (with one torch thread, the worker's default on a shared machine, all of it)."""
        try:
            started = time.thread_time() if timed else 0.0  # a system call: only when asked
            result = run(request)
            cpu_s = time.thread_time() - started if timed else None
            check_reply_size(routed, request.hidden.shape[0], self.store.hidden_size,
                             request.mode == CombineMode.EXACT, result.outputs)
            return result.to_frame(rid, cpu_s)
        except MoeSwarmError as error:
            log.info("request %d refused: %s", rid, printable(str(error)))
            return ErrorReply("bad_request", str(error)).to_frame(rid)
        except Exception as error:  # a bug on our side: report it and keep serving
            log.exception("request %d failed", rid)
            return ErrorReply("internal", printable(f"{type(error).__name__}: {error}")).to_frame(rid)
