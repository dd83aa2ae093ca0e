"""A worker's decode DISPATCHes answered whole in C: a lane's constants (ExpressLane), the RESULT
frame written in one call (kernels/qk_express.c), and a connection held and answered between
frames (kernels/qk_hold.c)."""

from __future__ import annotations

import ctypes

import numpy as np

from moeswarm.kernels.qk_experts import ExpertsPlan
from moeswarm.kernels import qk_library
from moeswarm.kernels.qk_matmul import _address
from moeswarm.kernels.qk_mirrors import ExpressLane, Hold, HoldOut


def express_lane(plan: ExpertsPlan, tokens: int, k: int, id_bytes: int, hidden_at: int, ids_at: int, weights_at: int,
                 table: np.ndarray, meta: bytes, timed: bool, exact: bool = False,
                 first: int = 0, served: np.ndarray | None = None) -> tuple[ExpressLane, tuple]:
    """The lane for DISPATCHes of `tokens` x `k` whose x, ids and w lie at these offsets of a frame's
    body; meta: the RESULT's metadata bytes (partial, timed: up to its last value, "cpu_us"'s;
    exact: up to its row count); first: the id of the plan's expert 0 (exact); served: [plan's
    experts] int64, contiguous, or None: every answer adds each expert's rows to it (the worker's
    measured load). Returns the struct and what it points into (keep both alive together)."""
    if served is not None:
        assert served.dtype == np.int64 and served.shape == (plan.num_experts,) and served.flags.c_contiguous
    n = max(plan.num_experts, 1)
    counts, hit = np.zeros(n, np.int64), np.zeros(n, np.int64)
    sums = np.zeros((tokens * k if exact else tokens, plan.hidden), np.float32)
    meta_buffer = ctypes.create_string_buffer(meta, len(meta))
    lane = ExpressLane(plan.set_at, tokens, k, id_bytes, hidden_at, ids_at, weights_at,
                       _address(table), len(table), _address(counts), _address(sums), ctypes.addressof(meta_buffer),
                       len(meta), int(timed), _address(hit), first, None if served is None else _address(served))
    return lane, (plan, table, counts, hit, sums, meta_buffer, served)


def express_answer(lane: ExpressLane, exact: bool, body: bytes, reply: bytearray, request_id: int, threads: int) -> int:
    """The RESULT frame answering a DISPATCH (its frame's body) into `reply`, in one C call: its
    length, or below zero with nothing to send (-3: an id not held or no slot routed)."""
    where = ctypes.addressof(ctypes.c_char.from_buffer(reply))  # no array type made per call
    run = qk_library._library().qk_express_rows if exact else qk_library._library().qk_express_sums
    return run(ctypes.byref(lane), body, where, len(reply), request_id, threads)


def hold(lanes: ctypes.Array, n_lanes: int, max_tokens: int, fd: int, loop_fd: int, wait_s: float, limit_s: float,
         into: bytearray, reply: bytearray, answer: ctypes._CFuncPtr, threads: int, out: HoldOut) -> int:
    """Answer a connection's DISPATCHes of learned lanes of at most `max_tokens` as they come, in C
    (kernels/qk_hold.c `qk_hold`): why it ended (worker/hold.py's outcomes), `out` what it did."""
    call = Hold(ctypes.addressof(lanes), n_lanes, max_tokens, fd, loop_fd, wait_s, limit_s,
                ctypes.addressof(ctypes.c_char.from_buffer(into)), len(into),
                ctypes.addressof(ctypes.c_char.from_buffer(reply)), len(reply), answer, threads, ctypes.addressof(out))
    return qk_library._library().qk_hold(call)
