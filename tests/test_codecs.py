"""Wire codecs: pinned bytes, bounded error, and what happens to zeros, huge values, NaN and inf."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.errors import ProtocolError
from moeswarm.wire.codecs import FLOAT_CODECS, get_codec


def _round_trip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    data = codec.encode(x)
    assert len(data) == codec.nbytes(tuple(x.shape))
    return codec.decode(memoryview(data), tuple(x.shape), x.dtype)


GOLDEN = {
    "f32": "0000803f0000c0bf00000000",
    "f16": "003c00be0000",
    "bf16": "803fc0bf0000",
    # one block of 3: scale bf16(1.5 / 127) = 0x3c42 (0.01184), codes round(x / scale) = 84, -127, 0
    "int8-b32": "423c" "5481" "00",
    # scale bf16(1.5 / 448) = 0x3b5b, codes e4m3(299.25) = 288 (0x79), e4m3(-448.9 clamped to -448) = 0xfe
    "fp8-b32": "5b3b" "79fe" "00",
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    x = torch.tensor([1.0, -1.5, 0.0])
    assert bytes(get_codec(name).encode(x)).hex() == GOLDEN[name]


def test_sizes_for_the_reference_layer():
    # hidden size 3072: the byte plan of the brief, per token
    sizes = {name: get_codec(name).nbytes((1, 3072)) for name in FLOAT_CODECS}
    assert sizes["f32"] == 12288 and sizes["f16"] == 6144 and sizes["bf16"] == 6144
    assert sizes["int8-b128"] == sizes["fp8-b128"] == 3072 + 24 * 2
    assert sizes["int8-b32"] == 3072 + 96 * 2


finite = st.floats(min_value=-2.0**100, max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=300), st.sampled_from(FLOAT_CODECS))
def test_error_is_bounded(values, name):
    x = torch.tensor(values, dtype=torch.float32).view(1, -1)
    y = _round_trip(name, x)
    err = (y - x).abs()
    if name == "f32":
        assert torch.equal(y, x)
    elif name == "bf16":
        assert (err <= x.abs() * 2**-8 + 1e-38).all()
    elif name == "f16":
        limit = torch.finfo(torch.float16).max
        inside = x.abs() <= limit
        assert (err[inside] <= x.abs()[inside] * 2**-11 + 2**-24).all()
        assert torch.equal(y[~inside], x[~inside].sign() * limit)  # saturates, never inf
    else:
        block = int(name.split("-b")[1])
        width = x.shape[1]
        for start in range(0, width, block):
            xs, es = x[0, start : start + block], err[0, start : start + block]
            top = float(xs.abs().max())
            relative = 2**-4 if name.startswith("fp8") else 0.0
            assert (es <= xs.abs() * relative + top * 0.0081 + 1e-37).all(), (name, xs, es)


@pytest.mark.parametrize("name", FLOAT_CODECS)
def test_zeros_stay_zero(name):
    x = torch.zeros(2, 130)
    assert torch.equal(_round_trip(name, x), x)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_casts_carry_nan_and_inf(name):
    x = torch.tensor([[math.nan, math.inf, -math.inf, 1.0]])
    y = _round_trip(name, x)
    assert math.isnan(y[0, 0]) and y[0, 1] == math.inf and y[0, 2] == -math.inf and y[0, 3] == 1.0


@pytest.mark.parametrize("name", [n for n in FLOAT_CODECS if "-b" in n])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_blockwise_codecs_refuse_non_finite(name, bad):
    x = torch.ones(1, 64)
    x[0, 5] = bad
    with pytest.raises(ProtocolError, match=f"{name} cannot carry non-finite values"):
        get_codec(name).encode(x)


def test_shapes_beyond_one_row_and_ragged_blocks():
    x = torch.randn(3, 5, 100)  # last axis not a multiple of the block
    for name in FLOAT_CODECS:
        y = _round_trip(name, x)
        assert y.shape == x.shape
        assert torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0) > 0.999
