"""Property tests of every parser a worker or a backbone runs on bytes from the network.

For each: arbitrary input either parses or raises ProtocolError, never another exception; and
valid messages survive encode -> parse unchanged (bit for bit for lossless codecs).
"""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from moeswarm.errors import ProtocolError
from moeswarm.wire import tensors as wire_tensors
from moeswarm.wire.codecs import CODECS, DTYPES, get_codec
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER, HEADER_SIZE, MAGIC, MAX_META_BYTES, VERSION, Frame, Opcode, decode_meta, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result, WorkerInfo
from moeswarm.wire.stream import decode_frame

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEAVY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # large drawn values
MESSAGES = {Opcode.HELLO: (Hello, WorkerInfo), Opcode.DISPATCH: (Dispatch,), Opcode.RESULT: (Result,),
            Opcode.ERROR: (ErrorReply,)}

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12) | st.sampled_from(["x", "ids", "w", "y", "f32", "u8", "exact", "partial"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=24)
dims = st.integers(0, 6) | st.sampled_from([-1, 2**31 - 1, 2**31, 2**40])
descriptor = st.tuples(st.sampled_from(["x", "ids", "w", "y"]) | st.text(max_size=3),
                       st.sampled_from(sorted(CODECS)) | values,
                       st.sampled_from(sorted(DTYPES)) | values,
                       st.lists(dims, max_size=5) | values).map(list)
descriptors = st.lists(descriptor | values, max_size=5) | values
meta_maps = st.fixed_dictionaries(
    {}, optional={"layer": st.integers(-2, 4) | values, "mode": st.sampled_from(["exact", "partial"]) | values,
                  "combine": st.sampled_from(sorted(CODECS)) | values, "tensors": descriptors,
                  "fingerprint": st.text(max_size=8) | values, "role": values, "protocol": values,
                  "model_type": st.text(max_size=8) | values, "num_experts": st.integers(-1, 70000) | values,
                  "hidden_size": st.integers(-1, 64) | values, "codecs": st.lists(st.text(max_size=4)) | values,
                  "held": st.lists(st.lists(st.integers(-1, 9) | st.lists(st.integers(-1, 9), max_size=4) | values,
                                            max_size=3), max_size=3) | values,
                  "experts": st.lists(st.integers(-1, 9), max_size=4) | values,
                  "counts": st.lists(st.integers(-1, 9), max_size=4) | values,
                  "code": values, "message": values})


def only_protocol_errors(parse, *args):
    """`parse(*args)`; a ProtocolError is an answer, any other exception fails the test."""
    try:
        return parse(*args)
    except ProtocolError:
        return None


# -- the frame header and metadata --------------------------------------------------------------------


@FAST
@given(st.binary(max_size=40))
def test_any_bytes_as_a_header(data):
    header = only_protocol_errors(parse_header, data)
    if header is not None:
        assert len(data) == HEADER_SIZE and data[:4] == MAGIC and data[4] == VERSION
        assert header.meta_len <= MAX_META_BYTES


@FAST
@given(st.integers(0, 255), st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1), st.integers(0, MAX_META_BYTES),
       st.integers(0, 2**30))
def test_valid_headers_round_trip(opcode, flags, request_id, meta_len, payload_len):
    header = parse_header(HEADER.pack(MAGIC, VERSION, opcode, flags, request_id, meta_len, payload_len))
    assert (header.opcode, header.flags, header.request_id, header.meta_len, header.payload_len) == (
        opcode, flags, request_id, meta_len, payload_len)


@FAST
@given(st.binary(max_size=200))
def test_any_bytes_as_metadata(data):
    meta = only_protocol_errors(decode_meta, data)
    assert meta is None or isinstance(meta, dict)


@HEAVY
@given(st.dictionaries(st.text(max_size=8), values, max_size=6))
def test_metadata_round_trips(meta):
    assume(not _has_nan(meta))
    assert decode_meta(msgpack.packb(meta, use_bin_type=True)) == meta


def _has_nan(value) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, dict):
        return any(_has_nan(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_nan(v) for v in value)
    return False


# -- tensors and codecs ---------------------------------------------------------------------------------


@HEAVY
@given(descriptors, st.binary(max_size=600))
def test_any_descriptors_and_payload(descs, payload):
    out = only_protocol_errors(wire_tensors.unpack, descs, payload)
    if out is not None:
        for name, tensor in out.items():
            assert tensor.numel() > 0


@FAST
@given(st.sampled_from(sorted(CODECS)), st.sampled_from(sorted(DTYPES)), st.lists(st.integers(1, 5), min_size=1,
                                                                                     max_size=3), st.data())
def test_any_bytes_of_the_right_length_decode(codec_name, dtype_name, shape, data):
    codec = get_codec(codec_name)
    raw = data.draw(st.binary(min_size=codec.nbytes(tuple(shape)), max_size=codec.nbytes(tuple(shape))))
    out = only_protocol_errors(wire_tensors.unpack, [["t", codec_name, dtype_name, shape]], raw)
    assert out is None or tuple(out["t"].shape) == tuple(shape)


LOSSLESS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "u8": torch.uint8,
            "i16": torch.int16, "i32": torch.int32, "i64": torch.int64}


@FAST
@given(st.sampled_from(sorted(LOSSLESS)), st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(0, 2**31))
def test_lossless_codecs_round_trip_bit_for_bit(codec_name, shape, seed):
    dtype = LOSSLESS[codec_name]
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        tensor = (torch.randn(*shape, generator=generator) * 1e3).to(dtype)
        tensor.view(-1)[0] = float("nan") if seed % 3 == 0 else float("inf")
    else:
        info = torch.iinfo(dtype)
        tensor = torch.randint(info.min, info.max, tuple(shape), generator=generator, dtype=torch.int64).to(dtype)
    descs, buffers = wire_tensors.pack([("t", tensor, codec_name)])
    back = wire_tensors.unpack(descs, b"".join(bytes(b) for b in buffers))["t"]
    assert back.dtype == dtype and torch.equal(_bits(back), _bits(tensor))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(widths[tensor.element_size()])


@FAST
@given(st.sampled_from([c for c in sorted(CODECS) if "-b" in c]), st.integers(1, 4), st.integers(1, 300),
       st.integers(0, 2**31))
def test_blockwise_codecs_round_trip_to_a_fixed_point(codec_name, rows, width, seed):
    """Lossy, but decode(encode(x)) encodes to the same bytes: nothing drifts on a second trip."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    descs, buffers = wire_tensors.pack([("t", x, codec_name)])
    once = wire_tensors.unpack(descs, b"".join(bytes(b) for b in buffers))["t"]
    assert once.shape == x.shape and torch.isfinite(once).all()
    assert (once - x).abs().max() <= x.abs().max() / 8 + 1e-6


# -- every message ---------------------------------------------------------------------------------------


@HEAVY
@given(st.sampled_from(sorted(MESSAGES)), meta_maps, st.binary(max_size=400))
def test_any_metadata_and_payload_for_every_message(opcode, meta, payload):
    frame = Frame(Opcode(opcode), 1, meta, payload)
    for message in MESSAGES[opcode]:
        only_protocol_errors(message.from_frame, frame)


@FAST
@given(st.sampled_from(list(Opcode)) | st.integers(0, 255), st.integers(0, 2**64 - 1),
       st.binary(max_size=120) | values.map(lambda v: msgpack.packb(v, use_bin_type=True)), st.binary(max_size=300))
def test_any_body_through_the_whole_chain(opcode, request_id, meta, payload):
    """Header, metadata, frame, message: what the worker and the backbone run on a received frame."""
    data = HEADER.pack(MAGIC, VERSION, int(opcode), 0, request_id, len(meta), len(payload)) + meta + payload
    header = parse_header(data[:HEADER_SIZE])
    frame = only_protocol_errors(decode_frame, header, data[HEADER_SIZE:])
    if frame is not None:
        for message in MESSAGES.get(frame.opcode, ()):
            only_protocol_errors(message.from_frame, frame)


def _dispatch_bytes(tokens: int, k: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(8, generator=generator)[:k] for _ in range(tokens)])
    ids[0, -1] = -1
    return Dispatch(1, torch.randn(tokens, 16, generator=generator), ids,
                    torch.rand(tokens, k, generator=generator)).to_frame(5).to_bytes()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 1000),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6))
def test_mutated_dispatch_frames_parse_or_raise_protocol_error(tokens, k, seed, edits):
    data = bytearray(_dispatch_bytes(tokens, k, seed))
    for where, value in edits:
        data[where % len(data)] = value
    header = only_protocol_errors(parse_header, bytes(data[:HEADER_SIZE]))
    assume(header is not None and len(data) - HEADER_SIZE >= header.meta_len)
    body = bytes(data[HEADER_SIZE:])
    frame = only_protocol_errors(decode_frame, header, body[: header.body_len] if header.body_len <= len(body) else body)
    if frame is not None and frame.opcode == Opcode.DISPATCH:
        only_protocol_errors(Dispatch.from_frame, frame)


# -- valid messages round-trip ----------------------------------------------------------------------------


def _reparse(frame: Frame) -> Frame:
    data = frame.to_bytes()
    header = parse_header(data[:HEADER_SIZE])
    return decode_frame(header, data[HEADER_SIZE:])


@FAST
@given(st.integers(1, 9), st.integers(1, 4), st.integers(1, 40), st.integers(2, 300), st.integers(0, 2**31),
       st.sampled_from(["f32", "f16", "bf16"]), st.sampled_from(list(CombineMode)), st.integers(0, 4095))
def test_dispatch_round_trips(tokens, k, hidden, experts, seed, combine, mode, layer):
    k = min(k, experts)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])  # [T, k]
    ids[:, -1] = torch.where(torch.rand(tokens, generator=generator) < 0.3, -1, ids[:, -1])
    sent = Dispatch(layer, torch.randn(tokens, hidden, generator=generator), ids, torch.rand(tokens, k, generator=generator),
                    mode, "f32", combine)
    got = Dispatch.from_frame(_reparse(sent.to_frame(9)))
    assert (got.layer, got.mode, got.wire_combine) == (layer, mode, combine)
    assert torch.equal(got.hidden, sent.hidden) and torch.equal(got.top_k_index, ids)
    assert torch.equal(got.top_k_weights, sent.top_k_weights)


@FAST
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(1, 32), st.integers(0, 2**31),
       st.sampled_from(list(CombineMode)))
def test_result_round_trips(counts, hidden, seed, mode):
    rows = sum(counts)
    outputs = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
    experts = list(range(0, 2 * len(counts), 2))
    sent = Result(3, mode, outputs, experts if mode == CombineMode.EXACT else [],
                  counts if mode == CombineMode.EXACT else [])
    got = Result.from_frame(_reparse(sent.to_frame(4)))
    assert (got.layer, got.mode, got.experts, got.counts) == (3, mode, sent.experts, sent.counts)
    assert torch.equal(got.outputs, outputs)


@FAST
@given(st.text(max_size=30), st.text(max_size=10), st.integers(1, 512), st.integers(1, 4096),
       st.dictionaries(st.integers(0, 4095), st.sets(st.integers(0, 511), min_size=1, max_size=6), max_size=4),
       st.lists(st.sampled_from(sorted(CODECS)), max_size=4))
def test_hello_messages_round_trip(fingerprint, model_type, num_experts, hidden, held, codecs):
    held = {layer: tuple(sorted(e % num_experts for e in experts)) for layer, experts in held.items()}
    held = {layer: tuple(sorted(set(experts))) for layer, experts in held.items()}
    info = WorkerInfo(fingerprint, model_type, num_experts, hidden, held, tuple(codecs))
    assert WorkerInfo.from_frame(_reparse(info.to_frame(1))) == info
    assert Hello.from_frame(_reparse(Hello(fingerprint).to_frame(2))) == Hello(fingerprint)


@FAST
@given(st.text(max_size=20), st.text(max_size=200))
def test_error_replies_round_trip(code, message):
    assert ErrorReply.from_frame(_reparse(ErrorReply(code, message).to_frame(3))) == ErrorReply(code, message)


@pytest.mark.parametrize("shape", [[0, 2**31 - 1], [2**31 - 1, 0], [0], [3, 0, 5]])
def test_empty_tensors_are_refused_by_name(shape):
    with pytest.raises(ProtocolError, match=rf"^tensor 'x': shape \[{', '.join(map(str, shape))}\] has no elements$"):
        wire_tensors.unpack([["x", "f32", "f32", shape]], b"")
