"""A decode step's layer call on a plain TCP socket in C (moeswarm/transport/token_call.c), through ctypes.

`pip install -e .` builds the C file into `moeswarm/_token_call*.so`. Without it `available()` is
False and every call takes the Python path (dispatch/express_call.py); nothing else changes.

`tc_send` writes one holder's DISPATCH from a template (a frame the full path encoded, wire/messages.py)
with the token's values in it; `tc_take` reads the holder's RESULT, checks it against the metadata
bytes the full path would accept and adds its rows into the step's output. Outcomes below zero
are named in OUTCOMES; after `tc_take` returns OTHER_FRAME or MISMATCH the frame is whole in the
buffer (the full path judges it), after any other failure the stream is out of step.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from moeswarm import native
from moeswarm.wire import frames

_I64, _PTR, _INT, _DOUBLE = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double

TIMEOUT, CLOSED, BAD_HEADER, OTHER_REQUEST, TOO_BIG, OTHER_FRAME, MISMATCH, IO, BAD_ID = range(-1, -10, -1)
OUTCOMES = {TIMEOUT: "timeout", CLOSED: "closed", BAD_HEADER: "bad header", OTHER_REQUEST: "reply to another request",
            TOO_BIG: "reply over its bound", OTHER_FRAME: "not a RESULT", MISMATCH: "not as expected",
            IO: "socket error", BAD_ID: "expert id out of range"}
WHOLE = (OTHER_FRAME, MISMATCH)  # outcomes that leave the frame whole in the buffer


class Send(ctypes.Structure):
    """tc_send's arguments (transport/token_call.h TcSend)."""

    _fields_ = [("fd", _I64), ("frame", _PTR), ("len", _I64), ("rid", ctypes.c_uint64), ("x_at", _I64), ("x", _PTR),
                ("d", _I64), ("ids_at", _I64), ("id_bytes", _I64), ("ids", _PTR), ("k", _I64), ("owner", _PTR),
                ("num_experts", _I64), ("me", _I64), ("w_at", _I64), ("w", _PTR), ("deadline", _DOUBLE)]


class Take(ctypes.Structure):
    """tc_take's arguments (transport/token_call.h TcTake)."""

    _fields_ = [("fd", _I64), ("rid", ctypes.c_uint64), ("buf", _PTR), ("cap", _I64), ("meta", ctypes.c_char_p),
                ("meta_len", _I64), ("timed", _I64), ("rows", _I64), ("d", _I64), ("first", _I64), ("out", _PTR),
                ("deadline", _DOUBLE), ("info", _PTR), ("top", _PTR), ("doze", _DOUBLE), ("spin", _DOUBLE)]


@cache
def _library() -> ctypes.CDLL | None:
    lib = native.load("_token_call")
    if lib is None:
        return None
    native.check_layout("_token_call", native.reported(lib, "tc_layout"), {"TcSend": Send, "TcTake": Take},
                        {**frames.c_constants(), "TC_TIMEOUT": TIMEOUT, "TC_CLOSED": CLOSED, "TC_BAD_HEADER": BAD_HEADER,
                         "TC_OTHER_REQUEST": OTHER_REQUEST, "TC_TOO_BIG": TOO_BIG, "TC_OTHER_FRAME": OTHER_FRAME,
                         "TC_MISMATCH": MISMATCH, "TC_IO": IO, "TC_BAD_ID": BAD_ID})
    lib.tc_send.argtypes, lib.tc_send.restype = [ctypes.POINTER(Send)], _INT
    lib.tc_take.argtypes, lib.tc_take.restype = [ctypes.POINTER(Take)], _I64
    return lib


def available() -> bool:
    return _library() is not None


def functions() -> tuple:
    """(tc_send, tc_take) as ctypes functions (None, None when not built), each called with its struct
    (`Send`, `Take`; addresses as ints):

    Send(fd, frame, length, request_id, x_at, x, d, ids_at, id_bytes, ids, k, owner, E, me, w_at, w,
         deadline): the template at `frame` [length] sent with `request_id`, x [d] float32, ids [k]
         int64 (holder `me`'s by owner [E] int64, the others -1) and w [k] float32 written at the
         template's offsets; tc_send returns 0, or an outcome below zero.
    Take(fd, request_id, buf, cap, meta, meta_len, timed, rows, d, first, out, deadline, info, top, doze, spin):
         the RESULT into buf [cap], checked against `meta` (timed: plus a last "cpu_us"), its
         rows x d float32 added into out [d] (first: out = y + 0.0); info [3] int64 gets the
         frame's opcode, meta_len and body length, top [1] float64 its largest |value|; it sleeps
         up to `doze` seconds for the reply (woken by it), then spins up to `spin` seconds before
         it sleeps in poll (dispatch/wait.py). tc_take returns the RESULT's cpu_us (0 untimed), or
         an outcome below zero.
    deadline: time.monotonic() seconds; meta: an address, or bytes (kept alive by the struct)."""
    lib = _library()
    return (lib.tc_send, lib.tc_take) if lib is not None else (None, None)


def address(array: np.ndarray | bytearray) -> int:
    """The address of a contiguous numpy array's (or a bytearray's) first byte."""
    if isinstance(array, bytearray):
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return array.__array_interface__["data"][0]
