"""The C kernels (moeswarm/kernels/qkernels.c) against gguf-py's decoders, and their determinism.

Blocks are random bytes with sane scale fields, for every type the kernels decode; gguf-py's
numpy decoders (what llama.cpp's own Python package ships) are the oracle of the values.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants

from moeswarm.kernels import qkernels

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")

# Byte ranges of each block's float16 scale fields (random bytes there would be NaN or huge).
HALF_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2],
               Q.Q5_K: [0, 2], Q.Q6_K: [208]}
QUANTIZED = [*HALF_FIELDS, Q.MXFP4]
ALL = [Q.F32, Q.F16, Q.BF16, *QUANTIZED]


def random_rows(qtype: Q, rows: int, row_length: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8 of valid `qtype` blocks."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal((rows, row_length)).astype(np.float32)
        if qtype == Q.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(np.float16 if qtype == Q.F16 else np.float32).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, row_length // block, size), dtype=np.uint8)
    for at in HALF_FIELDS.get(qtype, []):
        scales = (rng.random((rows, row_length // block)) * 0.02 + 0.001).astype(np.float16)
        blocks[:, :, at:at + 2] = scales.view(np.uint8).reshape(rows, row_length // block, 2)
    if qtype == Q.MXFP4:
        blocks[:, :, 0] = rng.integers(118, 130, (rows, row_length // block), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def oracle(qtype: Q, raw: np.ndarray, row_length: int) -> torch.Tensor:
    if qtype == Q.F32:
        values = raw.view(np.float32)
    elif qtype == Q.F16:
        values = raw.view(np.float16).astype(np.float32)
    else:
        values = quants.dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(raw.shape[0], row_length))


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_decoding_matches_gguf_py(qtype):
    raw = random_rows(qtype, 6, 512)
    assert torch.equal(qkernels.dequantize(int(qtype), raw, 512), oracle(qtype, raw, 512))


# Types whose products are integer dots of the weight quants with int8-quantized activations.
INTEGER = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def quantized_activations(qtype: Q, x: torch.Tensor) -> torch.Tensor:
    """x [n, K] as the kernels see it for an integer type: blocks of 32 (256 for K-quants) rounded to
    d * q, q = rint(x * 127 / amax) in [-127, 127] and d = amax / 127, in float32 as the C code does."""
    block = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32
    values = x.numpy().astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(values).max(-1, keepdims=True)
    tiny = np.float32(2.0**-100)
    inv = np.where(amax >= tiny, np.float32(127) / np.maximum(amax, tiny), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(values * inv), -127, 127)
    return torch.from_numpy((q * (amax / np.float32(127)).astype(np.float32)).astype(np.float64).reshape(x.shape))


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_product_is_close_to_the_decoded_matmul(qtype):
    raw = random_rows(qtype, 37, 256, seed=1)  # 37 rows: a partial row tile
    x = torch.randn(5, 256)
    expected = x.double() @ oracle(qtype, raw, 256).double().T  # [5, 37]
    got = qkernels.matmul(int(qtype), raw, 256, x, threads=1).double()  # decoded, dotted in float32
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    if qtype not in INTEGER:
        return
    got = qkernels.matmul(int(qtype), raw, 256, x, threads=1, int8_activations=True).double()
    # int8 activations: each x value is off by up to d / 2 = amax / 254 of its block (a relative
    # rounding error of ~0.5% rms for Gaussian x), so the product is off by ~0.5-1% of its scale, not 1e-4.
    error = got - expected
    assert float(error.norm() / expected.norm()) < 2e-2
    assert float(error.abs().max()) < 5e-2 * float(expected.abs().max())
    # ... and it is the product with exactly those quantized activations, up to float32 rounding.
    exact = quantized_activations(qtype, x) @ oracle(qtype, raw, 256).double().T
    assert torch.allclose(got, exact, rtol=1e-5, atol=2e-5 * float(exact.abs().max()))


def row_length_of(qtype: Q) -> int:
    return 768 if GGML_QUANT_SIZES[qtype][0] == 256 else 800  # 800: 25 blocks, an odd count


@pytest.mark.parametrize("qtype, int8", [(Q.F16, False), (Q.MXFP4, False), (Q.Q4_K, False), *((q, True) for q in INTEGER)],
                         ids=lambda v: v.name if isinstance(v, Q) else ("int8" if v else "f32"))
def test_bits_depend_only_on_the_row_and_the_token(qtype, int8):
    """Same bits whatever the thread count, the other tokens and rows of the call, or the buffers' alignment."""
    K = row_length_of(qtype)
    mm = partial(qkernels.matmul, int8_activations=int8)
    raw = random_rows(qtype, 64, K, seed=2)
    x = torch.randn(9, K) * torch.logspace(-3, 3, 9)[:, None]  # tokens of very different scales
    alone = torch.cat([mm(int(qtype), raw, K, x[t:t + 1], threads=1) for t in range(9)])
    for threads in (1, 2, 3, 7):
        assert torch.equal(mm(int(qtype), raw, K, x, threads=threads), alone)
    for pick in ([4, 0, 8], [5, 6], [1, 2, 3, 7, 8]):  # other token tiles (K-quants: 5 in a wide tile of 8)
        assert torch.equal(mm(int(qtype), raw, K, x[pick], threads=1), alone[pick])
    for threads in (1, 2, 3):  # 23 rows: on 2 and 3 threads tiles of 8 rows, the last one 7
        assert torch.equal(mm(int(qtype), raw[17:40], K, x, threads=threads), alone[:, 17:40])
    shifted_x = torch.empty(9 * K + 3)[3:].view(9, K)  # 12 bytes off torch's 64-byte alignment
    shifted_x.copy_(x)
    buffer = np.empty(raw.size + 5, dtype=np.uint8)
    shifted_w = buffer[5:].reshape(raw.shape)
    shifted_w[...] = raw
    assert torch.equal(mm(int(qtype), shifted_w, K, shifted_x, threads=2), alone)


@pytest.mark.parametrize("qtype", INTEGER, ids=lambda q: q.name)
def test_every_implementation_gives_the_same_bits(qtype):
    """The scalar code and each SIMD one this CPU runs (AVX2, AVX-VNNI, AVX512-VNNI), forced in turn:
    20 tokens and 13 of them, so the K-quants' wide tiles (8 tokens, AVX-512's 16 too) run full and
    partial."""
    K = row_length_of(qtype)
    raw = random_rows(qtype, 37, K, seed=4)
    x = torch.randn(20, K) * torch.logspace(-2, 2, 20)[:, None]
    x[3] = 0  # an all-zero token: amax 0, every q 0
    x[4, :40] *= 1e30  # one huge block beside ordinary ones
    results = {}
    try:
        for name in qkernels.ISAS:
            if qkernels.use_isa(name) == name:
                results[name] = qkernels.matmul(int(qtype), raw, K, x, threads=2, int8_activations=True)
                results[name, 13] = qkernels.matmul(int(qtype), raw, K, x[5:18], threads=1, int8_activations=True)
    finally:
        qkernels.use_isa(None)
    for name, y in results.items():
        if isinstance(name, tuple):
            assert torch.equal(y, results["scalar"][5:18]), f"{name[0]} differs from the scalar code (13 tokens)"
        else:
            assert torch.equal(y, results["scalar"]), f"{name} differs from the scalar code"
    assert torch.all(results["scalar"][3] == 0) and torch.isfinite(results["scalar"]).all()


# What each implementation needs, as /proc/cpuinfo names the flags.
ISA_FLAGS = {"scalar": set(), "avx2": {"avx2", "fma", "f16c"}, "avxvnni": {"avx2", "fma", "f16c", "avx_vnni"},
             "avx512vnni": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}}


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU's flags from /proc/cpuinfo")
def test_an_implementation_is_used_only_where_the_cpu_runs_it():
    """The levels do not nest (AMD's Zen 4 has AVX512-VNNI without AVX-VNNI): forcing one the CPU
    lacks falls back to the best it runs instead of an illegal instruction."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    runs = [name for name in qkernels.ISAS if ISA_FLAGS[name] <= flags]
    try:
        for name in qkernels.ISAS:
            assert (qkernels.use_isa(name) == name) == (name in runs), name
            assert qkernels.use_isa(name) in runs
    finally:
        qkernels.use_isa(None)
    assert qkernels.isa() == runs[-1]  # the best one it runs


def test_odd_row_lengths_of_float_types():
    raw = random_rows(Q.F16, 3, 37, seed=3)
    x = torch.randn(2, 37)
    expected = x.double() @ oracle(Q.F16, raw, 37).double().T
    assert torch.allclose(qkernels.matmul(int(Q.F16), raw, 37, x, threads=1).double(), expected, atol=1e-5)
    assert not qkernels.supported(int(Q.Q4_K), 128), "a K-quant row must be whole 256-value blocks"
    assert not qkernels.supported(int(Q.Q3_K), 256), "Q3_K is dequantized to float32 at load instead"


def test_every_half_precision_value_decodes_exactly():
    """All 65536 F16 bit patterns (subnormals, infinities, NaNs) as numpy converts them, bit for bit."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(1, -1)
    expected = halves.view(np.float16).astype(np.float32).view(np.int32)
    got = qkernels.dequantize(int(Q.F16), halves.view(np.uint8), 1 << 16).numpy().view(np.int32)
    assert np.array_equal(got, expected)


def test_the_integer_types_are_the_ones_listed():
    assert qkernels.INT8_TYPES == {int(q) for q in INTEGER}


def unfused_expert(gate, up, down, x, activation, biases=None, alpha=1.702, limit=7.0, threads=1):
    """The per-matrix sequence qk_expert fuses: (qtype, raw [rows, row_bytes]) for gate, up [I, H], down [H, I]."""
    H, I = x.shape[1], gate[1].shape[0]
    g = qkernels.matmul(int(gate[0]), gate[1], H, x, threads, int8_activations=True)  # [n, I]
    u = qkernels.matmul(int(up[0]), up[1], H, x, threads, int8_activations=True)  # [n, I]
    if activation == "silu":
        h = qkernels.silu_glu(g, u)
    else:
        h = qkernels.oss_glu(g + biases[0], u + biases[1], alpha, limit)
    out = qkernels.matmul(int(down[0]), down[1], I, h, threads, int8_activations=True)  # [n, H]
    return out + biases[2] if biases is not None else out


def blocks(qtype: Q, raw: np.ndarray) -> qkernels.Blocks:
    return qkernels.Blocks(int(qtype), qkernels.address(raw), raw.shape[0], raw.nbytes)


FUSED_TYPES = [(Q.Q4_K,) * 3, (Q.Q6_K,) * 3, (Q.Q8_0,) * 3, (Q.Q5_0,) * 3, (Q.MXFP4,) * 3, (Q.F16,) * 3,
               (Q.Q4_K, Q.Q4_K, Q.Q6_K),  # Q4_K_M's experts
               (Q.Q8_0, Q.Q4_K, Q.MXFP4)]  # gate and up of different block sizes: x quantized twice


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
@pytest.mark.parametrize("types", FUSED_TYPES, ids=lambda t: "-".join(q.name for q in t))
def test_a_fused_expert_gives_the_bits_of_its_products_in_turn(types, activation):
    """qkernels.expert (one C call: x's int8 blocks shared by gate and up, scratch inside C) against
    matmul, matmul, silu_glu / biases and oss_glu, matmul, + down bias: the same bits."""
    H, I = 512, 256
    gate, up = random_rows(types[0], I, H, seed=5), random_rows(types[1], I, H, seed=6)
    down = random_rows(types[2], H, I, seed=7)
    x = torch.randn(6, H) * torch.logspace(-2, 2, 6)[:, None]
    x[2] = 0  # an all-zero row
    biases = (torch.randn(I), torch.randn(I), torch.randn(H)) if activation == "gpt_oss" else None
    kwargs = dict(gate_bias=biases[0], up_bias=biases[1], down_bias=biases[2], alpha=1.702, limit=7.0) if biases else {}
    for rows in ([0], [1, 2, 3], list(range(6))):
        expected = unfused_expert((types[0], gate), (types[1], up), (types[2], down), x[rows], activation, biases)
        for threads in (1, 3):
            got = qkernels.expert(blocks(types[0], gate), blocks(types[1], up), blocks(types[2], down), x[rows],
                                  threads, activation, **kwargs)
            assert torch.equal(got, expected), f"rows {rows}, {threads} threads"


@pytest.mark.parametrize("qtype, K", [(Q.Q5_0, 192), (Q.Q4_K, 512), (Q.Q8_0, 128), (Q.F16, 8)], ids=lambda v: getattr(v, "name", str(v)))
def test_a_product_per_head_gives_each_heads_own_bits(qtype, K):
    """matmul_heads (latent attention's W_uk and W_uv per head, forward/latent.py): head h's
    columns of x times head h's matrix, the bits of `matmul` on them alone, on any thread count."""
    heads, rows = 5, 48
    raw = np.stack([random_rows(qtype, rows, K, seed=h) for h in range(heads)])  # [H, rows, row_bytes]
    x = torch.randn(3, heads, K)
    for int8 in (True, False):
        alone = torch.stack([qkernels.matmul(int(qtype), raw[h], K, x[:, h].contiguous(), 1, int8) for h in range(heads)], 1)
        for threads in (1, 2, 3, 8):
            assert torch.equal(qkernels.matmul_heads(int(qtype), raw, K, x, threads, int8), alone)


def test_a_resting_pool_wakes_for_every_next_product():
    """`qkernels.rest` (a backbone before its layer call's wait, a worker between requests) sends the
    pool's helpers to sleep at once: every product after it still runs all its jobs, with the bits of
    one thread, whether the helpers were spinning, asleep or on their way to sleep."""
    import threading

    K = 256
    raw, x = random_rows(Q.Q4_K, 40, K, seed=3), torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    alone = qkernels.matmul(int(Q.Q4_K), raw, K, x, threads=1, int8_activations=True)
    got = []

    def products():
        for i in range(300):
            got.append(torch.equal(qkernels.matmul(int(Q.Q4_K), raw, K, x, threads=3, int8_activations=True), alone))
            if i % 3:
                qkernels.rest()  # at once, or after the helpers had every chance to fall asleep by themselves
            if i % 50 == 0:
                threading.Event().wait(0.002)

    runner = threading.Thread(target=products, daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "a product after rest() never finished: a helper slept through its call"
    assert got == [True] * 300
