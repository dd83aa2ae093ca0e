"""AVX512-VNNI's Q6_K product on 16 rows side by side (moeswarm/kernels/qk_q6k16.h) gives each
(row, token) the bits of the one-row, one-token product, whatever the batch, the rows around it
(16-row groups and the rows left over), the thread count, the choice of when it runs, and the same
bits as the scalar code. On a CPU without AVX512-VNNI the same assertions hold of the other
implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moeswarm.kernels import qkernels
from test_q4k_rows16 import BATCHES, tokens
from test_quant_kernels import random_rows

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")


def alone(raw: np.ndarray, K: int, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: [n, rows]."""
    return torch.cat([qkernels.matmul(int(Q.Q6_K), raw, K, x[t:t + 1], 1, True) for t in range(x.shape[0])])


@pytest.fixture
def restore_tuning():
    before = qkernels.tuning()
    yield
    qkernels.tune(before["prefetch"], before["wide_from"], before["wide16"], before["rows16_from"],
                  before["q6k_rows16_from"])


@pytest.mark.parametrize("rows, K", [(16, 256), (53, 768), (64, 2048)])
def test_each_row_and_token_has_its_own_bits_in_any_batch(rows, K, restore_tuning):
    raw = random_rows(Q.Q6_K, rows, K, seed=rows)
    x = tokens(max(BATCHES), K, seed=K)
    expected = alone(raw, K, x)
    tuned = qkernels.tuning()
    for q6k_rows16_from in (2, 5, 0):  # from 2 tokens on, from 5, never: the same bits
        qkernels.tune(tuned["prefetch"], tuned["wide_from"], tuned["wide16"], tuned["rows16_from"], q6k_rows16_from)
        for n in BATCHES:
            for threads in (1, 2):
                got = qkernels.matmul(int(Q.Q6_K), raw, K, x[:n], threads, True)
                assert torch.equal(got, expected[:n]), f"{n} tokens, {threads} threads, from {q6k_rows16_from}"
    qkernels.tune(tuned["prefetch"], tuned["wide_from"], tuned["wide16"], tuned["rows16_from"], 2)
    picked = [69, 2, 40, 7, 7, 11, 30, 5, 60]  # other neighbours, a token twice
    assert torch.equal(qkernels.matmul(int(Q.Q6_K), raw, K, x[picked], 1, True), expected[picked])
    assert torch.equal(qkernels.matmul(int(Q.Q6_K), raw[3:3 + 16], K, x[:20], 1, True), expected[:20, 3:3 + 16])


def test_the_largest_sums_are_exact_and_match_the_scalar_code(restore_tuning):
    """Every quant 63, every scale -128 or 127, x at +-127 in runs of one sign: the 16-value sums at their
    bound (16 * 63 * 127, beyond an int16), the same bits as the scalar code and as each token alone."""
    K, rows = 512, 32
    raw = random_rows(Q.Q6_K, rows, K, seed=1).reshape(rows, K // 256, 210)
    raw[:, :, 0:192] = 0xff  # every quant 63
    raw[:, :, 192:208:2] = 0x80  # scales -128 and 127 in turn
    raw[:, :, 193:208:2] = 0x7f
    raw = np.ascontiguousarray(raw.reshape(rows, -1))
    x = torch.ones(12, K)
    x[1::2] = -1.0
    x[2, 16:32] = -1.0
    expected = alone(raw, K, x)
    assert torch.equal(qkernels.matmul(int(Q.Q6_K), raw, K, x, 1, True), expected)
    try:
        assert qkernels.use_isa("scalar") == "scalar"
        scalar = qkernels.matmul(int(Q.Q6_K), raw, K, x, 1, True)
    finally:
        qkernels.use_isa(None)
    assert torch.equal(scalar, expected)
