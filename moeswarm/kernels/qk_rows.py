"""Row operations in C (kernels/qk_rows.c and qkernels.c): RMSNorm, rotary embeddings, one query's
attention, the experts' activations, ordered row adds and a peak. Each is the bits of the torch or
numpy operations it replaces; where a thread count is taken, the bits do not depend on it."""

from __future__ import annotations

import numpy as np
import torch

from moeswarm.kernels import qk_library
from moeswarm.kernels.qk_matmul import _address
from moeswarm.kernels.qk_mirrors import Attend, Rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out [N, d] (contiguous) = RMSNorm of x [N, d] (rows of stride >= d, values contiguous) with weight [d]."""
    n, d = x.shape
    assert x.dtype is weight.dtype is out.dtype is torch.float32 and x.stride(1) == 1 and weight.stride(0) == 1
    assert weight.shape[0] == d and out.is_contiguous() and out.numel() == n * d
    qk_library._library().qk_rms_norm(x.data_ptr(), n, d, x.stride(0), weight.data_ptr(), eps, out.data_ptr())


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """torch's (x * cos) + (rotate_half(x) * sin) with cos, sin unsqueezed at 1, the same bits:
    x [B, H, T, D] float32 (last dimension contiguous), cos, sin [B, T, D] -> [B, H, T, D], strided as x."""
    out = torch.empty_like(x)
    B, H, T, D = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    xs, os = x.stride(), out.stride()
    assert os[3] == 1 and xs[3] == 1
    call = Rope(x.data_ptr(), xs[0], xs[1], xs[2], out.data_ptr(), os[0], os[1], os[2], B, H, T, D, cos.data_ptr(),
                sin.data_ptr())
    qk_library._library().qk_rope_call(call)
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
    qk_library._library().qk_rope_table(positions.data_ptr(), positions.numel(), inv_freq.data_ptr(), h, scale,
                                        cos.data_ptr(), sin.data_ptr())
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
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    call = Attend(q.data_ptr(), qs[0], qs[1], qs[2], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1],
                  vs[2], B, Hq, Hkv, p, D, Dv, scale, out.data_ptr(), scratch.data_ptr(), threads,
                  k.dtype is not torch.float32)
    qk_library._library().qk_attend_one_call(call)
    return out


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise ([n, I] float32, contiguous)."""
    out = torch.empty_like(gate)
    qk_library._library().qk_silu_glu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def oss_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped swiglu: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    out = torch.empty_like(gate)
    qk_library._library().qk_oss_glu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), alpha, limit)
    return out


def add_rows(total: np.ndarray, rows: np.ndarray) -> None:
    """total [d] += each row of rows [n, d] in order (float32, IEEE single adds: numpy's bits), in one
    C call; numpy's adds where the C kernels are not built."""
    library = qk_library._library()
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
    library = qk_library._library()
    if library is None or values.dtype != np.float32 or not values.flags.c_contiguous:
        if values.size == 0:
            return 0.0
        magnitudes = np.abs(values)
        return float("nan") if np.isnan(magnitudes).any() else float(magnitudes.max())
    return library.qk_peak(_address(values), values.size)

