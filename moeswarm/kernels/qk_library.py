"""The C kernels' library (moeswarm/_qkernels*.so, built from kernels/qkernels.c and its companions):
loaded once, its layout checked against the ctypes mirrors (qk_mirrors.py), its functions declared,
and its host-wide settings (the implementation of the integer dots, the speed choices).

`pip install -e .` builds it (pyproject.toml's [[tool.setuptools.ext-modules]]). When it is missing
(no compiler at install time), `available()` is False, one log line says so, and GGUF experts are
dequantized to float32 as before.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

from moeswarm import native
from moeswarm.kernels import qk_mirrors
from moeswarm.wire import frames

log = logging.getLogger(__name__)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@cache
def _library() -> ctypes.CDLL | None:
    lib = native.load("_qkernels")
    if lib is None:
        log.warning("moeswarm's C kernels (moeswarm/_qkernels) are not built: GGUF experts are dequantized to float32 "
                    "(reinstall with `pip install -e .` and a C compiler to keep them quantized)")
        return None
    native.check_layout("_qkernels", native.reported(lib, "qk_layout"), qk_mirrors.mirrors(), frames.c_constants())
    by = ctypes.POINTER  # a mirror's instance is passed by reference
    lib.qk_supported.argtypes = [ctypes.c_int, _I64]
    lib.qk_matmul_call.argtypes = [by(qk_mirrors.Matmul)]
    lib.qk_matmul_heads_call.argtypes = [by(qk_mirrors.MatmulHeads)]
    lib.qk_expert_call.argtypes = [by(qk_mirrors.Expert)]
    lib.qk_experts_call.argtypes = [by(qk_mirrors.Experts)]
    lib.qk_dispatch_sums_call.argtypes = lib.qk_dispatch_rows_call.argtypes = [by(qk_mirrors.Dispatch)]
    lib.qk_rope_call.argtypes = [by(qk_mirrors.Rope)]
    lib.qk_attend_one_call.argtypes = [by(qk_mirrors.Attend)]
    lib.qk_rope_call.restype = lib.qk_attend_one_call.restype = None
    lib.qk_hold.argtypes, lib.qk_hold.restype = [by(qk_mirrors.Hold)], _I64
    lib.qk_dequantize.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR]
    lib.qk_silu_glu.argtypes = [_PTR, _PTR, _PTR, _I64]
    lib.qk_oss_glu.argtypes = [_PTR, _PTR, _PTR, _I64, ctypes.c_float, ctypes.c_float]
    lib.qk_silu_glu.restype = lib.qk_oss_glu.restype = None
    lib.qk_express_sums.argtypes = lib.qk_express_rows.argtypes = [_PTR, ctypes.c_char_p, _PTR, _I64,
                                                                    ctypes.c_uint64, ctypes.c_int]
    lib.qk_express_sums.restype = lib.qk_express_rows.restype = _I64
    lib.qk_add_rows.argtypes, lib.qk_add_rows.restype = [_PTR, _PTR, _I64, _I64], None
    lib.qk_peak.argtypes, lib.qk_peak.restype = [_PTR, _I64], ctypes.c_double
    lib.qk_rms_norm.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR]
    lib.qk_rope_table.argtypes = [_PTR, _I64, _PTR, _I64, ctypes.c_float, _PTR, _PTR]
    lib.qk_rms_norm.restype = lib.qk_rope_table.restype = None
    lib.qk_use_isa.argtypes = [ctypes.c_int]
    lib.qk_isa.argtypes = []
    lib.qk_pool_rest.argtypes, lib.qk_pool_rest.restype = [], None
    lib.qk_pool_spin_ns.argtypes, lib.qk_pool_spin_ns.restype = [], ctypes.c_longlong
    lib.qk_tune.argtypes = [ctypes.c_int] * 5
    lib.qk_tuning.argtypes, lib.qk_tuning.restype = [ctypes.POINTER(ctypes.c_int)], None
    lib.qk_evict.argtypes, lib.qk_evict.restype = [_PTR, _I64], None
    _tune(lib)
    return lib


def _tune(lib: ctypes.CDLL) -> None:
    """The speed choices for this host (kernel_tuning.py: forced, cached or measured now), set once."""
    global TUNING_SOURCE
    from moeswarm.kernels import kernel_tuning

    try:
        chosen, TUNING_SOURCE = kernel_tuning.choose(lib, ISAS[lib.qk_isa()])
    except ValueError as error:  # a bad MOESWARM_QK_TUNING: said once, the built-in choices used
        log.warning("%s; the built-in kernel choices are used", error)
        chosen, TUNING_SOURCE = kernel_tuning.DEFAULT, "default (MOESWARM_QK_TUNING refused)"
    chosen.apply(lib)


TUNING_SOURCE = "not chosen yet"  # where the tuning in force came from (kernel_tuning.choose)


def tuning() -> dict:
    """The speed choices in force (kernel_tuning.py) and where they came from."""
    from moeswarm.kernels.kernel_tuning import PREFETCH

    out = (ctypes.c_int * 5)()
    _library().qk_tuning(out)
    return {"prefetch": PREFETCH[out[0]], "wide_from": out[1], "wide16": out[2], "rows16_from": out[3],
            "q6k_rows16_from": out[4],
            "source": TUNING_SOURCE,
            "spin_ns": _library().qk_pool_spin_ns()}


def tune(prefetch: str, wide_from: int, wide16: int, rows16_from: int = 2, q6k_rows16_from: int = 4) -> None:
    """Set the speed choices (for tests that prove every choice gives the same bits)."""
    from moeswarm.kernels.kernel_tuning import Tuning

    Tuning(prefetch, wide_from, wide16, rows16_from, q6k_rows16_from).apply(_library())


def available() -> bool:
    return _library() is not None


# GGUF types with an integer path (matmul's int8_activations): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
INT8_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})

# The integer dot products' implementations (qk_use_isa's levels), all bit-identical.
ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")


def isa() -> str:
    """The implementation of the integer dot products in use (chosen once: MOESWARM_QK_ISA, else the best)."""
    return ISAS[_library().qk_isa()]


def use_isa(name: str | None) -> str:
    """Use implementation `name` (one of ISAS; None or one this CPU lacks: the best it has) -> the one in use.
    Every implementation gives the same bits; this is for tests that prove it."""
    return ISAS[_library().qk_use_isa(ISAS.index(name) if name is not None else -1)]


def rest() -> None:
    """The kernels' helper threads stop spinning and sleep until the next product (qk_pool.c): for a
    process about to wait on others, whose cores they would take meanwhile."""
    lib = _library()
    if lib is not None:
        lib.qk_pool_rest()


def supported(qtype: int, row_length: int) -> bool:
    """Whether rows of `row_length` values of GGUF type `qtype` are computed from their blocks."""
    lib = _library()
    return lib is not None and bool(lib.qk_supported(int(qtype), row_length))

