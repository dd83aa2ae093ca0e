"""The ctypes mirrors of the C kernels' structs (kernels/qk_express.h, qk_hold.h, qk_calls.h), whose
sizes and offsets the library reports at load (kernels/qk_layout.c; qk_library.py refuses one that
differs: moeswarm/native.py). Each entry of the library that ctypes calls with more than a few
arguments takes one of these by pointer (qk_calls.h): integers are int64 and flags 0 or 1."""

from __future__ import annotations

import ctypes

_I64, _PTR, _F32, _F64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double


class ExpressLane(ctypes.Structure):
    """A DISPATCH lane's constants for qk_express_sums / qk_express_rows (kernels/qk_express.c's
    QkLane): the experts (the address of an ExpertsPlan's `set`), where x, ids and w lie in a frame's
    body, scratch, and the RESULT's metadata bytes (exact: up to its row count)."""

    _fields_ = [("set", _PTR), ("tokens", _I64), ("k", _I64), ("id_bytes", _I64), ("hidden_at", _I64),
                ("ids_at", _I64), ("weights_at", _I64), ("table", _PTR), ("table_len", _I64), ("counts", _PTR),
                ("sums", _PTR), ("meta", _PTR), ("meta_len", _I64), ("timed", _I64), ("hit", _PTR), ("first", _I64),
                ("served", _PTR)]


# A hold's answer to a lane it has no ExpressLane for (kernels/qk_hold.c QkHoldAnswer): (lane index,
# the DISPATCH frame's body, its length, request id, reply, its room) -> the RESULT frame's length, < 0: declined
HOLD_ANSWER = ctypes.CFUNCTYPE(_I64, _I64, _PTR, _I64, ctypes.c_uint64, _PTR, _I64)


class HoldLane(ctypes.Structure):
    """A learned lane as the connection hold finds it (kernels/qk_hold.c's QkHoldLane): its DISPATCH's
    metadata bytes and payload size, and the ExpressLane that answers it (None: the hold's HOLD_ANSWER)."""

    _fields_ = [("meta", _PTR), ("meta_len", _I64), ("payload_len", _I64), ("lane", _PTR), ("exact", _I64),
                ("tokens", _I64)]


class HoldOut(ctypes.Structure):
    """What a hold did (kernels/qk_hold.c's QkHoldOut): frames answered and their tokens, a declined
    frame's length, a reply's unsent bytes."""

    _fields_ = [("answered", _I64), ("tokens", _I64), ("pending", _I64), ("unsent_at", _I64), ("unsent_len", _I64)]



class Hold(ctypes.Structure):
    """qk_hold's arguments (kernels/qk_hold.h QkHold): the lanes [n_lanes] of at most max_tokens, the
    connection and the loop's selector, the waits (seconds), the frame and reply buffers, the answer
    for lanes without an ExpressLane, and where it says what it did."""

    _fields_ = [("lanes", _PTR), ("n_lanes", _I64), ("max_tokens", _I64), ("fd", _I64), ("loop_fd", _I64),
                ("wait_s", _F64), ("limit_s", _F64), ("in", _PTR), ("in_cap", _I64), ("reply", _PTR),
                ("reply_cap", _I64), ("answer", HOLD_ANSWER), ("threads", _I64), ("out", _PTR)]


class Matmul(ctypes.Structure):
    """qk_matmul_call's arguments (kernels/qk_calls.h QkMatmul): y [n, rows] = x [n, K] times W^T."""

    _fields_ = [("type", _I64), ("w", _PTR), ("rows", _I64), ("K", _I64), ("row_bytes", _I64), ("x", _PTR),
                ("n", _I64), ("ldx", _I64), ("y", _PTR), ("ldy", _I64), ("threads", _I64), ("int8", _I64)]


class MatmulHeads(ctypes.Structure):
    """qk_matmul_heads_call's arguments (kernels/qk_calls.h QkMatmulHeads): per head, `Matmul`'s."""

    _fields_ = [("type", _I64), ("w", _PTR), ("heads", _I64), ("head_bytes", _I64), ("rows", _I64), ("K", _I64),
                ("row_bytes", _I64), ("x", _PTR), ("n", _I64), ("ldx", _I64), ("y", _PTR), ("ldy", _I64),
                ("threads", _I64), ("int8", _I64)]


class Expert(ctypes.Structure):
    """qk_expert_call's arguments (kernels/qk_calls.h QkExpert): one expert on x [n, H] -> out [n, H]."""

    _fields_ = [("gate_type", _I64), ("gate", _PTR), ("up_type", _I64), ("up", _PTR), ("down_type", _I64),
                ("down", _PTR), ("H", _I64), ("I", _I64), ("x", _PTR), ("n", _I64), ("ldx", _I64),
                ("gate_bias", _PTR), ("up_bias", _PTR), ("down_bias", _PTR), ("activation", _I64), ("alpha", _F32),
                ("limit", _F32), ("out", _PTR), ("ldo", _I64), ("threads", _I64), ("int8", _I64)]


class ExpertSet(ctypes.Structure):
    """A layer's experts as qk_experts takes them (kernels/qk_calls.h QkExpertSet): made once per
    ExpertsPlan, pointed to by each call's `Experts` or `Dispatch`."""

    _fields_ = [("n_experts", _I64), ("gate", _PTR), ("up", _PTR), ("down", _PTR), ("gate_type", _I64),
                ("up_type", _I64), ("down_type", _I64), ("H", _I64), ("I", _I64), ("gate_bias", _PTR),
                ("up_bias", _PTR), ("down_bias", _PTR), ("activation", _I64), ("alpha", _F32), ("limit", _F32)]


class Experts(ctypes.Structure):
    """qk_experts_call's arguments (kernels/qk_calls.h QkExperts): the set's experts on hidden [S, H]
    routed by index and weights [S, k] -> final [S, H]."""

    _fields_ = [("set", _PTR), ("hidden", _PTR), ("S", _I64), ("ldx", _I64), ("index", _PTR),
                ("k", _I64), ("weights", _PTR), ("final", _PTR), ("threads", _I64), ("int8", _I64)]


class Dispatch(ctypes.Structure):
    """qk_dispatch_sums_call's and qk_dispatch_rows_call's arguments (kernels/qk_calls.h QkDispatch):
    a DISPATCH's tensors by address as they travel, the ids' table, and where the answer goes."""

    _fields_ = [("set", _PTR), ("hidden", _PTR), ("S", _I64), ("ids", _PTR),
                ("id_bytes", _I64), ("k", _I64), ("weights", _PTR), ("table", _PTR), ("table_len", _I64),
                ("out", _PTR), ("out_rows", _I64), ("counts", _PTR), ("hit", _PTR), ("n_hit", _PTR),
                ("threads", _I64), ("int8", _I64)]


class Rope(ctypes.Structure):
    """qk_rope_call's arguments (kernels/qk_calls.h QkRope): x, out [B, H, T, D] and their first three
    strides (three numbers each: ctypes sets an array field far slower), cos and sin [B, T, D]."""

    _fields_ = [("x", _PTR), ("xs0", _I64), ("xs1", _I64), ("xs2", _I64), ("out", _PTR), ("os0", _I64), ("os1", _I64),
                ("os2", _I64), ("B", _I64), ("H", _I64), ("T", _I64), ("D", _I64), ("cos", _PTR), ("sin", _PTR)]


class Attend(ctypes.Structure):
    """qk_attend_one_call's arguments (kernels/qk_calls.h QkAttend): q, k, v and their first three
    strides, the shape, the scale, out and scratch; half: k and v float16."""

    _fields_ = [("q", _PTR), ("qs0", _I64), ("qs1", _I64), ("qs2", _I64), ("k", _PTR), ("ks0", _I64), ("ks1", _I64),
                ("ks2", _I64), ("v", _PTR), ("vs0", _I64), ("vs1", _I64), ("vs2", _I64), ("B", _I64), ("Hq", _I64),
                ("Hkv", _I64), ("p", _I64), ("D", _I64), ("Dv", _I64), ("scale", _F32), ("out", _PTR),
                ("scratch", _PTR), ("threads", _I64), ("half", _I64)]


def mirrors() -> dict[str, type[ctypes.Structure]]:
    """C struct name -> its mirror here, as the library's layout report names them (looked up when
    called: a test swaps a mirror to see the load refuse it)."""
    return {"QkLane": ExpressLane, "QkHoldLane": HoldLane, "QkHoldOut": HoldOut, "QkHold": Hold,
            "QkMatmul": Matmul, "QkMatmulHeads": MatmulHeads, "QkExpert": Expert, "QkExpertSet": ExpertSet,
            "QkExperts": Experts, "QkDispatch": Dispatch, "QkRope": Rope, "QkAttend": Attend}
