"""Every layer call's bookkeeping, whatever path it took (dispatch/paths.py), in one place.

A call answered leaves three records: the holders whose answers count without a spot check
confirming them go in the taint ledger (dispatch/taint.py) at once, since a ban may come before
anything else; the call's `LayerCall` goes in the accounting; and its path `record`s its own part
(the holders' round trips and the plausibility gate's learning, where its `gather` left them).

A path that `defers` (the lane) leaves the last two for later: they are made before anything reads
or changes the holders' standing (`settle`), at the latest right after the next call's send, while
that call's holders compute. Only the thread that made the call records it: a dashboard reading
from another thread sees it a call late, and no thread but the dispatcher's writes the holders'
statistics. The accounting keeps calls in order: a record made meanwhile (an in-process layer's,
dispatch/in_process.py) makes the deferred one first.
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from moeswarm.dispatch.accounting import Accounting, LayerCall
from moeswarm.dispatch.parts import REFEREE
from moeswarm.dispatch.paths import CallPath, Gathered, Handle
from moeswarm.dispatch.pool import HolderPool
from moeswarm.worker.local_link import LOCAL_ADDRESS


class Books:
    """The bookkeeping of the layer calls of one dispatcher (`record` each; `settle` what is owed)."""

    def __init__(self, pool: HolderPool, accounting: Accounting):
        self.pool = pool
        self.accounting = accounting
        self._owed: tuple[CallPath, Gathered, int] | None = None  # a deferring path's call, and its thread

    def record(self, handle: Handle, answered: Gathered) -> None:
        """The bookkeeping of `handle`'s call, answered by its path (`answered`), combined now."""
        for holder in answered.unchecked:
            self.pool.ledger.used(holder, handle.call)
        seconds = time.perf_counter() - handle.started
        path = handle.path
        if not path.defers:
            path.record(answered)
            self.accounting.record(self._layer_call(handle, answered, seconds))
            return
        self.settle()  # another deferred call's, where calls of several groups are in flight
        self._owed = (path, answered, threading.get_ident())
        self.accounting.defer(functools.partial(self._deferred, handle, answered, seconds, self.accounting.decoding))

    def settle(self) -> None:
        """Make the deferred call's bookkeeping, where this thread made that call (see the docstring)."""
        owed = self._owed
        if owed is None or owed[2] != threading.get_ident():
            return  # settled by the thread that made the call (another one reading sees it a call late)
        self._owed = None
        owed[0].record(owed[1])
        self.accounting.flush()

    def _deferred(self, handle: Handle, answered: Gathered, seconds: float, decoding: bool) -> tuple[LayerCall, bool]:
        return self._layer_call(handle, answered, seconds), decoding

    def _layer_call(self, handle: Handle, answered: Gathered, seconds: float) -> LayerCall:
        address = self.address
        remote = answered.remote_rows
        if remote is None:
            trusted = self.pool.trusted
            remote = _rows(share.tokens for share, _, holder in answered.answers
                           if holder not in trusted and holder != REFEREE)
        return LayerCall(
            handle.layer, handle.hidden.shape[0], answered.bytes_out, answered.bytes_in, handle.round_trips, seconds,
            {address(holder): rtt for holder, rtt, _ in answered.answered}, remote,
            worker_cpu={address(holder): cpu for holder, _, cpu in answered.answered if cpu is not None},
            in_c=answered.in_c,
        )

    def address(self, worker: int) -> str:
        return LOCAL_ADDRESS if worker == REFEREE else self.pool.address_of(worker)


def _rows(tokens) -> int:
    """How many distinct rows of the step these [T_w] token index tensors cover."""
    tokens = [t.numpy() for t in tokens]
    if len(tokens) <= 1:
        return len(tokens[0]) if tokens else 0  # a share's tokens are distinct
    return len(np.unique(np.concatenate(tokens)))
