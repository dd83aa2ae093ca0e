"""AVX512-VNNI's Q4_K product on 16 rows side by side (moeswarm/kernels/qk_q4k16.h) gives each
(row, token) the bits of the one-row, one-token product, whatever the batch, the rows around it
(16-row groups and the rows left over), the thread count, and the same bits as the scalar code.
On a CPU without AVX512-VNNI the same assertions hold of the other implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moeswarm.kernels import qkernels
from test_quant_kernels import random_rows

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")

BATCHES = (1, 3, 4, 5, 8, 9, 16, 17, 63, 64, 65, 70)  # below and above the first tile, 8-token tiles, 64-token passes


def tokens(n: int, K: int, seed: int) -> torch.Tensor:
    """[n, K] float32 of very different scales, with an all-zero token and a huge block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, K, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    x[n // 2] = 0
    x[-1, :40] *= 1e30
    return x


def alone(raw: np.ndarray, K: int, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: [n, rows]."""
    return torch.cat([qkernels.matmul(int(Q.Q4_K), raw, K, x[t:t + 1], 1, True) for t in range(x.shape[0])])


@pytest.mark.parametrize("rows, K", [(16, 256), (53, 768), (64, 2048)])
def test_each_row_and_token_has_its_own_bits_in_any_batch(rows, K):
    raw = random_rows(Q.Q4_K, rows, K, seed=rows)
    x = tokens(max(BATCHES), K, seed=K)
    expected = alone(raw, K, x)
    for n in BATCHES:
        for threads in (1, 2):
            got = qkernels.matmul(int(Q.Q4_K), raw, K, x[:n], threads, True)
            assert torch.equal(got, expected[:n]), f"{n} tokens, {threads} threads"
    picked = [69, 2, 40, 7, 7, 11, 30, 5, 60]  # other neighbours, a token twice
    assert torch.equal(qkernels.matmul(int(Q.Q4_K), raw, K, x[picked], 1, True), expected[picked])
    assert torch.equal(qkernels.matmul(int(Q.Q4_K), raw[3:3 + 16], K, x[:20], 1, True), expected[:20, 3:3 + 16])


def test_the_largest_sums_are_exact_and_match_the_scalar_code():
    """Every quant 15, every scale and min 63, x at +-127 in runs of one sign: the 16-value sums at
    their bound (16 * 15 * 127), the same bits as the scalar code and as each token alone."""
    K, rows = 512, 32
    raw = random_rows(Q.Q4_K, rows, K, seed=1).reshape(rows, K // 256, 144)
    raw[:, :, 4:16] = 0xff  # the 6-bit scales and mins all 63
    raw[:, :, 16:] = 0xff  # every quant 15
    raw = np.ascontiguousarray(raw.reshape(rows, -1))
    x = torch.ones(12, K)
    x[1::2] = -1.0
    x[2, 16:32] = -1.0
    expected = alone(raw, K, x)
    assert torch.equal(qkernels.matmul(int(Q.Q4_K), raw, K, x, 1, True), expected)
    try:
        assert qkernels.use_isa("scalar") == "scalar"
        scalar = qkernels.matmul(int(Q.Q4_K), raw, K, x, 1, True)
    finally:
        qkernels.use_isa(None)
    assert torch.equal(scalar, expected)
