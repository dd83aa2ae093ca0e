"""Replies bounded before compute: the worker's reply budget and the watch over replies not taken.

A DISPATCH's RESULT is counted before the request is queued (worker/server.py `_handle`: a bound
from its declared shapes, worker/limits.py `reply_bound`) against its connection's unsent bound
(session.py, backpressure: `AwaitRoom`) and the worker's reply budget (`reply_room`: "busy"
beyond it); once its ids are decoded on the compute thread, its exact size is checked against
the connection's bound before any expert runs (`check_reply_bytes`). A client that does not take
its replies is closed after the frame timeout (`watch_replies`), which releases what they held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from moeswarm.errors import ProtocolError
from moeswarm.wire.config import CombineMode
from moeswarm.worker.admission import CountedLog
from moeswarm.worker.limits import SMALL_FRAME_BYTES, check_routing, reply_bytes
from moeswarm.worker.runner import WorkerBusy
from moeswarm.worker.session import Session

if TYPE_CHECKING:
    from moeswarm.wire.frames import Frame
    from moeswarm.wire.messages import Dispatch

log = logging.getLogger("moeswarm.worker")


class AwaitRoom:
    """A DISPATCH waiting for its connection's unsent replies to leave room for its RESULT (`owed`
    bytes); `submit` queues it then (its ERROR, or None once queued)."""

    __slots__ = ("owed", "submit")

    def __init__(self, owed: int, submit: Callable[[], Frame | None]):
        self.owed, self.submit = owed, submit


def reply_room(sessions: Iterable[Session], session: Session, owed: int, budget: int) -> None:
    """WorkerBusy unless a RESULT of `owed` bytes fits the worker's reply `budget` over all `sessions`.

    A small one always does while its connection holds little (bounded by connections x
    SMALL_FRAME_BYTES): decode steps get through while others' large replies fill the budget. The
    sum runs only for larger ones, whose compute dwarfs it.
    """
    if owed + session.unsent <= SMALL_FRAME_BYTES:
        return
    held = sum(s.unsent for s in sessions)
    if held + owed > budget:
        raise WorkerBusy(held, budget, f"bytes of replies held and {owed} more asked")


def check_reply_bytes(request: Dispatch, hidden: int, num_experts: int, limit: int) -> int:
    """S, the request's routed pairs; ProtocolError when its RESULT, at its exact size (S rows in
    exact mode, T in partial, in its combine codec), would be over `limit`, what one connection may
    hold unsent. Integer arithmetic on S, on the compute thread, before any expert runs."""
    exact = request.mode == CombineMode.EXACT
    routed = check_routing(request.top_k_index)
    rows = routed if exact else request.hidden.shape[0]
    size = reply_bytes(rows, hidden, request.wire_combine, min(routed, num_experts) if exact else 0)
    if size > limit:
        raise ProtocolError(f"RESULT of {size} bytes would be over the limit of {limit} bytes a connection may hold "
                            "unsent (worker flag --max-unsent-bytes): send fewer tokens per DISPATCH")
    return routed


async def watch_replies(sessions: dict[asyncio.Task, Session], timeout_s: float, logs: Iterable[CountedLog],
                        tls=None) -> None:
    """Until cancelled, every second (or a quarter of `timeout_s`): close connections whose client
    took no byte of their written replies for `timeout_s`, so a client that does not read holds its
    reply bytes that long, not for the idle timeout; report the counted logs that are due; and, with
    `tls` (the swarm key's server context), close the connections of members revoked since they
    connected (checked when the revocation list changes)."""
    from moeswarm.transport.tls import RevocationWatch

    revocations = RevocationWatch(tls) if tls is not None else None
    while True:
        await asyncio.sleep(min(1.0, timeout_s / 4))
        try:
            for counted in logs:
                counted.tick()
            now = time.monotonic()
            if revocations is not None and revocations.changed():
                _close_revoked(sessions)
            for session in list(sessions.values()):
                waiting = session.written_unsent
                if waiting == 0 or waiting < session.last_waiting:
                    session.progress_at = now
                session.last_waiting = waiting
                if waiting and now - session.progress_at > timeout_s and not session.writer.transport.is_closing():
                    log.warning("closing connection from %s: replies not taken for %g s", session.peer, timeout_s)
                    session.writer.transport.abort()
                    session.wake()
        except Exception:  # a bug here must not end the watch
            log.exception("the reply watch failed; it goes on")


def _close_revoked(sessions: dict[asyncio.Task, Session]) -> None:
    from moeswarm.transport.tls import revoked_reason

    for session in list(sessions.values()):
        why = revoked_reason(session.writer.get_extra_info("ssl_object"))
        if why is not None and not session.writer.transport.is_closing():
            log.warning("closing connection from %s: its member is no longer admitted: %s", session.peer, why)
            session.writer.transport.abort()
            session.wake()
