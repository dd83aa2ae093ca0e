"""The C kernels that compute from GGUF blocks (moeswarm/kernels/qkernels.c), through ctypes.

`pip install -e .` builds the C file into `moeswarm/_qkernels*.so` (pyproject.toml's
[[tool.setuptools.ext-modules]]). When the library is missing (no compiler at install time),
`available()` is False, one log line says so, and GGUF experts are dequantized to float32 as before.

Every function takes float32 torch tensors and returns new ones; the bits of each output value
depend only on its weight row and its input row (see the C file): never on the thread count.

The C code trusts the shapes it is given, so each wrapper asserts them first: a weight's bytes a
row equal what `row_length` values of its type take (`row_bytes`), and an expert's matrix holds
at least its rows' bytes (`Blocks.nbytes`). A model file's shapes reach here only after
gguf/gguf_header.py and gguf_bounds.py have checked them; these asserts are the last fence.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from moeswarm import native
from moeswarm.wire import frames

log = logging.getLogger(__name__)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_BLOCK_SIZES = {int(qtype): sizes for qtype, sizes in GGML_QUANT_SIZES.items()}  # type -> (values, bytes) a block


@cache
def _library() -> ctypes.CDLL | None:
    lib = native.load("_qkernels")
    if lib is None:
        log.warning("moeswarm's C kernels (moeswarm/_qkernels) are not built: GGUF experts are dequantized to float32 "
                    "(reinstall with `pip install -e .` and a C compiler to keep them quantized)")
        return None
    native.check_layout("_qkernels", native.reported(lib, "qk_layout"),
                        {"QkLane": ExpressLane, "QkHoldLane": HoldLane, "QkHoldOut": HoldOut}, frames.c_constants())
    lib.qk_supported.argtypes = [ctypes.c_int, _I64]
    lib.qk_matmul.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, ctypes.c_int,
                              ctypes.c_int]
    lib.qk_matmul_heads.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64,
                                    ctypes.c_int, ctypes.c_int]
    lib.qk_dequantize.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR]
    lib.qk_silu_glu.argtypes = [_PTR, _PTR, _PTR, _I64]
    lib.qk_oss_glu.argtypes = [_PTR, _PTR, _PTR, _I64, ctypes.c_float, ctypes.c_float]
    lib.qk_silu_glu.restype = lib.qk_oss_glu.restype = None
    lib.qk_expert.argtypes = [ctypes.c_int, _PTR, ctypes.c_int, _PTR, ctypes.c_int, _PTR, _I64, _I64, _PTR, _I64,
                              _I64, _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_float, ctypes.c_float, _PTR, _I64,
                              ctypes.c_int, ctypes.c_int]
    lib.qk_experts.argtypes = [_I64, _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64, _I64,
                               _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_int,
                               ctypes.c_float, ctypes.c_float, _PTR, ctypes.c_int, ctypes.c_int]
    lib.qk_dispatch_sums.argtypes = [_I64, _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64, _I64,
                                     _PTR, _I64, _PTR, ctypes.c_int, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
                                     ctypes.c_int, ctypes.c_float, ctypes.c_float, _PTR, _PTR, ctypes.c_int,
                                     ctypes.c_int]
    lib.qk_dispatch_rows.argtypes = [_I64, _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64, _I64,
                                     _PTR, _I64, _PTR, ctypes.c_int, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
                                     ctypes.c_int, ctypes.c_float, ctypes.c_float, _PTR, _I64, _PTR, _PTR, _PTR,
                                     ctypes.c_int, ctypes.c_int]
    lib.qk_express_sums.argtypes = lib.qk_express_rows.argtypes = [_PTR, ctypes.c_char_p, _PTR, _I64,
                                                                    ctypes.c_uint64, ctypes.c_int]
    lib.qk_express_sums.restype = lib.qk_express_rows.restype = _I64
    lib.qk_hold.argtypes = [_PTR, _I64, _I64, ctypes.c_int, ctypes.c_int, ctypes.c_double, ctypes.c_double, _PTR, _I64, _PTR,
                            _I64, HOLD_ANSWER, ctypes.c_int, _PTR]
    lib.qk_hold.restype = _I64
    lib.qk_add_rows.argtypes, lib.qk_add_rows.restype = [_PTR, _PTR, _I64, _I64], None
    lib.qk_peak.argtypes, lib.qk_peak.restype = [_PTR, _I64], ctypes.c_double
    lib.qk_rms_norm.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR]
    lib.qk_rope.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]
    lib.qk_attend_one.argtypes = lib.qk_attend_one_h.argtypes = [
        _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _PTR,
        ctypes.c_int]
    lib.qk_rope_table.argtypes = [_PTR, _I64, _PTR, _I64, ctypes.c_float, _PTR, _PTR]
    lib.qk_rms_norm.restype = lib.qk_rope.restype = lib.qk_rope_table.restype = lib.qk_attend_one.restype = None
    lib.qk_attend_one_h.restype = None
    lib.qk_use_isa.argtypes = [ctypes.c_int]
    lib.qk_isa.argtypes = []
    lib.qk_pool_rest.argtypes, lib.qk_pool_rest.restype = [], None
    lib.qk_pool_spin_ns.argtypes, lib.qk_pool_spin_ns.restype = [], ctypes.c_longlong
    lib.qk_tune.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
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

    out = (ctypes.c_int * 3)()
    _library().qk_tuning(out)
    return {"prefetch": PREFETCH[out[0]], "wide_from": out[1], "wide16": out[2], "source": TUNING_SOURCE,
            "spin_ns": _library().qk_pool_spin_ns()}


def tune(prefetch: str, wide_from: int, wide16: int) -> None:
    """Set the speed choices (for tests that prove every choice gives the same bits)."""
    from moeswarm.kernels.kernel_tuning import Tuning

    Tuning(prefetch, wide_from, wide16).apply(_library())


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


def row_bytes(qtype: int, row_length: int) -> int:
    """The bytes of one row of `row_length` values of GGUF type `qtype` (a whole number of blocks)."""
    block, type_size = _BLOCK_SIZES[int(qtype)]
    assert row_length > 0 and row_length % block == 0, f"rows of {row_length} values are not whole blocks of {block}"
    return row_length // block * type_size


def _address(array: np.ndarray | torch.Tensor) -> int:
    """The first byte's address (numpy's array interface: cheaper than `.ctypes.data`)."""
    return array.__array_interface__["data"][0] if isinstance(array, np.ndarray) else array.data_ptr()


def address(weight: np.ndarray) -> int:
    """The address of a [rows, row_bytes] matrix of blocks whose rows lie back to back (what the
    kernels read), taken once: `expert` and `experts` take matrices by address."""
    assert weight.ndim == 2 and weight.strides == (weight.shape[1] * weight.itemsize, weight.itemsize)
    return weight.ctypes.data


# qk_expert's activations.
ACTIVATIONS = {"silu": 0, "gpt_oss": 1}


def matmul(qtype: int, weight: np.ndarray, row_length: int, x: torch.Tensor, threads: int,
           int8_activations: bool = False) -> torch.Tensor:
    """x [n, K] float32 times W^T: W is weight [rows, row_bytes] of `qtype` blocks (K values a row) -> [n, rows].

    int8_activations: for the types in INT8_TYPES, quantize each x row to int8 blocks and take integer
    dot products (llama.cpp's scheme: several times faster, ~0.5-1% relative error from the int8
    rounding of x); otherwise (and for the other types) the decoded weights times float32 x. Either
    way each output's bits depend only on its weight row and its x row."""
    rows, stride = weight.shape
    n = x.shape[0]
    assert x.dtype == torch.float32 and x.shape[1] == row_length and x.stride(1) == 1 and weight.strides[1] == 1
    assert weight.strides[0] == stride == row_bytes(qtype, row_length)  # rows back to back, each whole
    y = torch.empty(n, rows, dtype=torch.float32)
    code = _library().qk_matmul(int(qtype), _address(weight), rows, row_length, stride,
                                x.data_ptr(), n, x.stride(0), y.data_ptr(), rows, threads, int(int8_activations))
    if code != 0:
        raise RuntimeError(f"qk_matmul failed for GGUF type {qtype} with rows of {row_length} values")
    return y


def matmul_heads(qtype: int, weight: np.ndarray, row_length: int, x: torch.Tensor, threads: int,
                 int8_activations: bool = False) -> torch.Tensor:
    """x [n, H, K] float32, head h times W_h^T: weight [H, rows, row_bytes] holds H matrices of `qtype`
    blocks (K values a row) -> [n, H, rows]. Each head is `matmul` on its matrix and columns (the same
    bits), all in one call: multi-head latent attention's absorbed products (forward/latent.py)."""
    heads, rows, stride = weight.shape
    n = x.shape[0]
    assert x.dtype == torch.float32 and x.shape[1:] == (heads, row_length) and x.stride(2) == 1 and x.stride(1) == row_length
    assert weight.strides == (rows * stride, stride, 1)  # matrices and their rows back to back
    assert stride == row_bytes(qtype, row_length)
    y = torch.empty(n, heads, rows, dtype=torch.float32)
    code = _library().qk_matmul_heads(int(qtype), _address(weight), heads, rows * stride, rows, row_length, stride,
                                      x.data_ptr(), n, x.stride(0), y.data_ptr(), heads * rows, threads,
                                      int(int8_activations))
    if code != 0:
        raise RuntimeError(f"qk_matmul_heads failed for GGUF type {qtype} with rows of {row_length} values")
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out [N, d] (contiguous) = RMSNorm of x [N, d] (rows of stride >= d, values contiguous) with weight [d]."""
    n, d = x.shape
    assert x.dtype is weight.dtype is out.dtype is torch.float32 and x.stride(1) == 1 and weight.stride(0) == 1
    assert weight.shape[0] == d and out.is_contiguous() and out.numel() == n * d
    _library().qk_rms_norm(x.data_ptr(), n, d, x.stride(0), weight.data_ptr(), eps, out.data_ptr())


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """torch's (x * cos) + (rotate_half(x) * sin) with cos, sin unsqueezed at 1, the same bits:
    x [B, H, T, D] float32 (last dimension contiguous), cos, sin [B, T, D] -> [B, H, T, D], strided as x."""
    out = torch.empty_like(x)
    B, H, T, D = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    strides = (ctypes.c_int64 * 3)(*x.stride()[:3])
    out_strides = (ctypes.c_int64 * 3)(*out.stride()[:3])
    assert out.stride(3) == 1 and x.stride(3) == 1
    _library().qk_rope(x.data_ptr(), strides, out.data_ptr(), out_strides, B, H, T, D, cos.data_ptr(), sin.data_ptr())
    return out


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of int64 positions [B, T] with float32 inv_freq [h]: cos, sin [B, T, 2 h], each
    (float)cos(float(p) * inv_freq[j]) * scale from double cos and sin (qk_rope_table), computed in this
    thread, a position's values from it alone."""
    assert positions.dtype is torch.int64 and inv_freq.dtype is torch.float32 and inv_freq.dim() == 1
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    h = inv_freq.shape[0]
    cos = torch.empty(*positions.shape, 2 * h, dtype=torch.float32)
    sin = torch.empty_like(cos)
    _library().qk_rope_table(positions.data_ptr(), positions.numel(), inv_freq.data_ptr(), h, scale, cos.data_ptr(),
                             sin.data_ptr())
    return cos, sin


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, threads: int = 1) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query per batch row, no mask: q [B, Hq, 1, D], k [B, Hkv, p, D],
    v [B, Hkv, p, Dv] (q float32; k and v both float32, or both float16: a float16 cache, each value
    widened where it is read, so the result is the float32 call's on k.float(), v.float(), bit for
    bit; last dimensions contiguous, Hq a multiple of Hkv, p >= 1) -> [B, 1, Hq, Dv] contiguous.
    The B * Hq heads are split among `threads` threads, each head whole on one: every output's bits
    depend on its own query, keys and values only, never on the thread count."""
    B, Hq, _, D = q.shape
    _, Hkv, p, Dv = v.shape
    assert q.dtype is torch.float32 and k.dtype is v.dtype and k.dtype in (torch.float32, torch.float16)
    assert q.shape[2] == 1 and p >= 1 and Hq % Hkv == 0
    assert k.shape == (B, Hkv, p, D) and q.stride(3) == k.stride(3) == v.stride(3) == 1
    threads = max(1, min(threads, B * Hq))
    out = torch.empty(B, 1, Hq, Dv, dtype=torch.float32)
    scratch = torch.empty(threads * p, dtype=torch.float32)
    qs, ks, vs = ((ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (q, k, v))
    library = _library()
    kernel = library.qk_attend_one if k.dtype is torch.float32 else library.qk_attend_one_h
    kernel(q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs, B, Hq, Hkv, p, D, Dv, scale, out.data_ptr(),
           scratch.data_ptr(), threads)
    return out


def dequantize(qtype: int, weight: np.ndarray, row_length: int) -> torch.Tensor:
    """weight [rows, row_bytes] of `qtype` blocks -> [rows, K] float32, decoded by the C kernels."""
    rows = weight.shape[0]
    assert weight.ndim == 2 and weight.shape[1] * weight.itemsize == row_bytes(qtype, row_length)
    out = torch.empty(rows, row_length, dtype=torch.float32)
    if _library().qk_dequantize(int(qtype), _address(np.ascontiguousarray(weight)), rows, row_length,
                                weight.shape[1], out.data_ptr()) != 0:
        raise RuntimeError(f"qk_dequantize failed for GGUF type {qtype} with rows of {row_length} values")
    return out


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise ([n, I] float32, contiguous)."""
    out = torch.empty_like(gate)
    _library().qk_silu_glu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def oss_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped swiglu: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    out = torch.empty_like(gate)
    _library().qk_oss_glu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), alpha, limit)
    return out


class Blocks(NamedTuple):
    """A [rows, K] matrix of GGUF blocks by `address` (its rows back to back), for `expert` and `experts`."""

    qtype: int
    address: int
    rows: int
    nbytes: int = -1  # the matrix's bytes, checked against rows and the row length (-1: unknown, refused)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    assert tensor.dtype == torch.float32 and tensor.is_contiguous()
    return tensor.data_ptr()


def expert(gate: Blocks, up: Blocks, down: Blocks, x: torch.Tensor, threads: int, activation: str = "silu",
           gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
           down_bias: torch.Tensor | None = None, alpha: float = 0.0, limit: float = 0.0,
           int8_activations: bool = True) -> torch.Tensor:
    """One expert in one C call: x [n, H] float32 -> [n, H]. gate, up: [I, H] blocks; down: [H, I].

    The bits of the sequence matmul(gate), matmul(up), then silu_glu, or for "gpt_oss" the gate and
    up biases added and oss_glu, then matmul(down) and + down_bias, each matmul with
    `int8_activations` (biases: float32, contiguous, [I], [I], [H]; None for none)."""
    n, hidden = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and up.rows == gate.rows and down.rows == hidden
    _check_blocks([gate], [up], [down])
    out = torch.empty(n, hidden, dtype=torch.float32)
    code = _library().qk_expert(gate.qtype, gate.address, up.qtype, up.address, down.qtype, down.address, hidden,
                                gate.rows, x.data_ptr(), n, x.stride(0), _pointer(gate_bias), _pointer(up_bias),
                                _pointer(down_bias), ACTIVATIONS[activation], alpha, limit, out.data_ptr(), hidden,
                                threads, int(int8_activations))
    if code != 0:
        raise RuntimeError(f"qk_expert failed for GGUF types {gate.qtype}, {up.qtype}, {down.qtype} "
                           f"(hidden size {hidden}, intermediate size {gate.rows})")
    return out


def _check_blocks(gate: list[Blocks], up: list[Blocks], down: list[Blocks]) -> None:
    """Every expert's gate and up [I, H] and down [H, I] hold at least their rows' bytes (what the C code reads)."""
    if not gate:
        return
    inner, hidden = gate[0].rows, down[0].rows
    for role, blocks, rows, row_length in (("gate", gate, inner, hidden), ("up", up, inner, hidden),
                                           ("down", down, hidden, inner)):
        for b in blocks:
            assert b.rows == rows and b.nbytes >= rows * row_bytes(b.qtype, row_length), (
                f"{role} blocks of {b.nbytes} bytes for {b.rows} rows of {row_length} values (type {b.qtype})")


class ExpertsPlan:
    """A layer's n experts as qk_experts takes them, every argument but the DISPATCH's computed once.

    gate, up, down: each expert's Blocks (one type per role); biases float32 [n, I], [n, I], [n, H] or None."""

    def __init__(self, gate: list[Blocks], up: list[Blocks], down: list[Blocks], activation: str,
                 gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 alpha: float, limit: float):
        n = len(gate)
        assert len({b.qtype for b in gate}) <= 1 and len({b.qtype for b in up}) <= 1 and len({b.qtype for b in down}) <= 1
        assert len(up) == len(down) == n
        _check_blocks(gate, up, down)
        self.num_experts = n
        self.hidden = down[0].rows if n else 0
        self._tables = [(ctypes.c_int64 * max(n, 1))(*(b.address for b in m)) for m in (gate, up, down)]
        self._biases = (gate_bias, up_bias, down_bias)  # kept alive: the C code reads them by address
        types = [m[0].qtype if n else 0 for m in (gate, up, down)]
        self._head = (n, *(ctypes.addressof(t) for t in self._tables), *types, self.hidden, gate[0].rows if n else 0)
        self._tail = (*(_pointer(b) for b in self._biases), ACTIVATIONS[activation], alpha, limit)


def dispatch_sums(plan: ExpertsPlan, hidden: int, tokens: int, ids: int, id_bytes: int, k: int, weights: int,
                  table: np.ndarray, final: np.ndarray, counts: np.ndarray, threads: int) -> int:
    """A partial DISPATCH's per-token sums from its frame's bytes, in one C call (the bits of `experts`
    on the same rows, ids and weights): hidden, ids and weights are the addresses of the tensors as
    they travel (float32 [tokens, H]; [tokens, k] ids of id_bytes each, u8 with 255 for -1; float32
    [tokens, k]), mapped through table [E + 3] (position id + 2, clipped: the id within this module,
    -1, or < -1 for not held). final [tokens, H] float32 zeros, counts [n] int64: written.
    0, -3 (an id not held here, or no slot routed: nothing computed), or another failure code."""
    assert final.dtype == np.float32 and final.shape == (tokens, plan.hidden) and final.flags.c_contiguous
    assert counts.dtype == np.int64 and counts.shape == (plan.num_experts,) and table.dtype == np.int64
    return _library().qk_dispatch_sums(*plan._head, hidden, tokens, ids, id_bytes, k, weights, _address(table),
                                       len(table), *plan._tail, _address(final), _address(counts), threads, 1)


class ExpressLane(ctypes.Structure):
    """A DISPATCH lane's constants for qk_express_sums / qk_express_rows (kernels/qk_express.c's
    QkLane): the experts, where x, ids and w lie in a frame's body, scratch, and the RESULT's
    metadata bytes (exact: up to its row count)."""

    _fields_ = [("n_experts", _I64), ("gate", _PTR), ("up", _PTR), ("down", _PTR), ("gate_type", _I64),
                ("up_type", _I64), ("down_type", _I64), ("H", _I64), ("I", _I64), ("gate_bias", _PTR),
                ("up_bias", _PTR), ("down_bias", _PTR), ("activation", _I64), ("alpha", ctypes.c_double),
                ("limit", ctypes.c_double), ("tokens", _I64), ("k", _I64), ("id_bytes", _I64), ("hidden_at", _I64),
                ("ids_at", _I64), ("weights_at", _I64), ("table", _PTR), ("table_len", _I64), ("counts", _PTR),
                ("sums", _PTR), ("meta", _PTR), ("meta_len", _I64), ("timed", _I64), ("hit", _PTR), ("first", _I64),
                ("served", _PTR)]


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
    n_experts, gate, up, down, gate_type, up_type, down_type, hidden, inner = plan._head
    gate_bias, up_bias, down_bias, activation, alpha, limit = plan._tail
    lane = ExpressLane(n_experts, gate, up, down, gate_type, up_type, down_type, hidden, inner, gate_bias, up_bias,
                       down_bias, activation, alpha, limit, tokens, k, id_bytes, hidden_at, ids_at, weights_at,
                       _address(table), len(table), _address(counts), _address(sums), ctypes.addressof(meta_buffer),
                       len(meta), int(timed), _address(hit), first, None if served is None else _address(served))
    return lane, (plan, table, counts, hit, sums, meta_buffer, served)


def express_answer(lane: ExpressLane, exact: bool, body: bytes, reply: bytearray, request_id: int, threads: int) -> int:
    """The RESULT frame answering a DISPATCH (its frame's body) into `reply`, in one C call: its
    length, or below zero with nothing to send (-3: an id not held or no slot routed)."""
    where = ctypes.addressof(ctypes.c_char.from_buffer(reply))  # no array type made per call
    run = _library().qk_express_rows if exact else _library().qk_express_sums
    return run(ctypes.byref(lane), body, where, len(reply), request_id, threads)


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


def hold(lanes: ctypes.Array, n_lanes: int, max_tokens: int, fd: int, loop_fd: int, wait_s: float, limit_s: float,
         into: bytearray, reply: bytearray, answer: ctypes._CFuncPtr, threads: int, out: HoldOut) -> int:
    """Answer a connection's DISPATCHes of learned lanes of at most `max_tokens` as they come, in C
    (kernels/qk_hold.c `qk_hold`): why it ended (worker/hold.py's outcomes), `out` what it did."""
    return _library().qk_hold(ctypes.addressof(lanes), n_lanes, max_tokens, fd, loop_fd, wait_s, limit_s,
                              ctypes.addressof(ctypes.c_char.from_buffer(into)), len(into),
                              ctypes.addressof(ctypes.c_char.from_buffer(reply)), len(reply), answer, threads,
                              ctypes.byref(out))


def dispatch_rows(plan: ExpertsPlan, hidden: int, tokens: int, ids: int, id_bytes: int, k: int, weights: int,
                  table: np.ndarray, rows: np.ndarray, found: np.ndarray, threads: int) -> int:
    """An exact DISPATCH's rows from its frame's bytes, in one C call (the bits of `experts` over the
    pairs' rows, as the worker's exact path runs it): addresses and table as in `dispatch_sums`.
    rows [tokens * k, H] float32 zeros: the routed pairs' rows w * E(x) first, experts ascending,
    each slot-major then token. found [2 n + 1] int64: the hit experts (within this module)
    ascending, then their row counts, then how many were hit. 0, -3 (nothing computed), or a failure code."""
    n = plan.num_experts
    assert rows.dtype == np.float32 and rows.shape == (tokens * k, plan.hidden) and rows.flags.c_contiguous
    assert found.dtype == np.int64 and found.shape == (2 * n + 1,) and table.dtype == np.int64
    base = _address(found)
    return _library().qk_dispatch_rows(*plan._head, hidden, tokens, ids, id_bytes, k, weights, _address(table),
                                       len(table), *plan._tail, _address(rows), rows.shape[0], base, base + 8 * n,
                                       base + 16 * n, threads, 1)


def add_rows(total: np.ndarray, rows: np.ndarray) -> None:
    """total [d] += each row of rows [n, d] in order (float32, IEEE single adds: numpy's bits), in one
    C call; numpy's adds where the C kernels are not built."""
    library = _library()
    if library is None or not (rows.flags.c_contiguous and total.flags.c_contiguous):
        for row in rows:
            np.add(total, row, out=total)
        return
    assert total.dtype == rows.dtype == np.float32 and rows.shape[1:] == total.shape
    library.qk_add_rows(_address(total), _address(rows), rows.shape[0], total.shape[0])


def peak(values: np.ndarray) -> float:
    """The largest |x| of a float32 array's values (NaN when one is NaN, inf when one is infinite):
    one C pass where numpy's isfinite, max and min take one pass each, each from cold caches;
    numpy's where the C kernels are not built."""
    library = _library()
    if library is None or values.dtype != np.float32 or not values.flags.c_contiguous:
        if values.size == 0:
            return 0.0
        magnitudes = np.abs(values)
        return float("nan") if np.isnan(magnitudes).any() else float(magnitudes.max())
    return library.qk_peak(_address(values), values.size)


def experts(plan: ExpertsPlan, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, threads: int,
            int8_activations: bool = True) -> torch.Tensor:
    """The layer's experts on S rows in one C call, in the eager experts' order and float operations:
    hidden [S, H] float32 (rows of stride >= H, values contiguous), index [S, k] int64 (< 0: none),
    weights [S, k] float32, both contiguous -> [S, H]: for e ascending, rows routed to e slot-major
    then token, final[token] += expert_e(hidden[token]) * weight, from zeros."""
    S, H = hidden.shape
    k = index.shape[1]
    assert hidden.dtype == torch.float32 and hidden.stride(1) == 1 and H == plan.hidden
    assert index.dtype == torch.int64 and index.is_contiguous() and index.shape == weights.shape == (S, k)
    assert weights.dtype == torch.float32 and weights.is_contiguous()
    final = torch.zeros(S, H, dtype=torch.float32)
    code = _library().qk_experts(*plan._head, hidden.data_ptr(), S, hidden.stride(0), index.data_ptr(), k,
                                 weights.data_ptr(), *plan._tail, final.data_ptr(), threads, int(int8_activations))
    if code == -2:
        bad = index[index >= plan.num_experts][0].item()
        raise ValueError(f"expert id {bad} out of range: this module holds experts 0-{plan.num_experts - 1}")
    if code != 0:
        raise RuntimeError(f"qk_experts failed (GGUF types {plan._head[4:7]}, out of memory or an unsupported type)")
    return final
