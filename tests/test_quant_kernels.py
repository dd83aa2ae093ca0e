"""The C kernels (moeswarm/weights/qkernels.c) against gguf-py's decoders, and their determinism.

Blocks are random bytes with sane scale fields, for every type the kernels decode; gguf-py's
numpy decoders (what llama.cpp's own Python package ships) are the oracle of the values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants

from moeswarm.weights import qkernels

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


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_product_is_close_to_the_decoded_matmul(qtype):
    raw = random_rows(qtype, 37, 256, seed=1)  # 37 rows: a partial row tile
    x = torch.randn(5, 256)
    expected = x.double() @ oracle(qtype, raw, 256).double().T  # [5, 37]
    got = qkernels.matmul(int(qtype), raw, 256, x, threads=1)
    assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_bits_depend_only_on_the_row_and_the_token():
    """Same bits whatever the thread count, the other tokens of the call, or the buffers' alignment."""
    raw = random_rows(Q.Q4_K, 64, 1024, seed=2)
    x = torch.randn(9, 1024)
    alone = torch.cat([qkernels.matmul(int(Q.Q4_K), raw, 1024, x[t:t + 1], threads=1) for t in range(9)])
    for threads in (1, 2, 3, 7):
        assert torch.equal(qkernels.matmul(int(Q.Q4_K), raw, 1024, x, threads=threads), alone)
    shifted_x = torch.empty(9 * 1024 + 3)[3:].view(9, 1024)  # 12 bytes off torch's 64-byte alignment
    shifted_x.copy_(x)
    buffer = np.empty(raw.size + 5, dtype=np.uint8)
    shifted_w = buffer[5:].reshape(raw.shape)
    shifted_w[...] = raw
    assert torch.equal(qkernels.matmul(int(Q.Q4_K), shifted_w, 1024, shifted_x, threads=2), alone)


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
