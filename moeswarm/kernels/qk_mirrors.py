"""The ctypes mirrors of the C kernels' structs (kernels/qk_express.h, qk_hold.c), whose sizes and
offsets the library reports at load (qk_library.py refuses one that differs: moeswarm/native.py)."""

from __future__ import annotations

import ctypes

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class ExpressLane(ctypes.Structure):
    """A DISPATCH lane's constants for qk_express_sums / qk_express_rows (kernels/qk_express.c's
    QkLane): the experts, where x, ids and w lie in a frame's body, scratch, and the RESULT's
    metadata bytes (exact: up to its row count)."""

    _fields_ = [("n_experts", _I64), ("gate", _PTR), ("up", _PTR), ("down", _PTR), ("gate_type", _I64),
                ("up_type", _I64), ("down_type", _I64), ("H", _I64), ("I", _I64), ("gate_bias", _PTR),
                ("up_bias", _PTR), ("down_bias", _PTR), ("activation", _I64), ("alpha", ctypes.c_double),
                ("limit", ctypes.c_double), ("tokens", _I64), ("k", _I64), ("id_bytes", _I64), ("hidden_at", _I64),
                ("ids_at", _I64), ("weights_at", _I64), ("table", _PTR), ("table_len", _I64), ("counts", _PTR),
                ("sums", _PTR), ("meta", _PTR), ("meta_len", _I64), ("timed", _I64), ("hit", _PTR), ("first", _I64)]



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



def mirrors() -> dict[str, type[ctypes.Structure]]:
    """C struct name -> its mirror here, as the library's layout report names them (looked up when
    called: a test swaps a mirror to see the load refuse it)."""
    return {"QkLane": ExpressLane, "QkHoldLane": HoldLane, "QkHoldOut": HoldOut}
