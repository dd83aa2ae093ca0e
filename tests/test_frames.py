"""The wire format is pinned: golden bytes, and every malformed header is refused by name."""

from __future__ import annotations

import pytest
import torch

from moeswarm.errors import ProtocolError
from moeswarm.wire.frames import HEADER_SIZE, Frame, Opcode, decode_meta, opcode_of, parse_header
from moeswarm.wire.config import CombineMode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result, WorkerInfo


def test_opcodes_are_pinned():
    assert [(o.name, o.value) for o in Opcode] == [
        ("HELLO", 1), ("DISPATCH", 2), ("RESULT", 3), ("ERROR", 4), ("PING", 5), ("PONG", 6),
        ("STEP", 7), ("STEP_RESULT", 8)]  # 7 and 8: the stage protocol (docs/stages.md)
    assert HEADER_SIZE == 24


def test_ping_golden_bytes():
    assert Frame(Opcode.PING, 7).to_bytes().hex() == "4d53574d02050000" "0700000000000000" "01000000" "00000000" "80"


def test_hello_golden_bytes():
    data = Hello("hf-abc").to_frame(1).to_bytes()
    assert data.hex() == (
        "4d53574d02010000" "0100000000000000" "2c000000" "00000000"
        "83a870726f746f636f6c02ab66696e6765727072696e74a66866"
        "2d616263a4726f6c65a86261636b626f6e65"
    )


def test_dispatch_golden_bytes():
    hidden = torch.tensor([[1.0, -2.0]])  # [T=1, d=2]
    index = torch.tensor([[3, -1]])  # [T, k=2]
    weights = torch.tensor([[0.5, 0.25]])
    data = Dispatch(4, hidden, index, weights).to_frame(9).to_bytes()
    header, body = data[:HEADER_SIZE], data[HEADER_SIZE:]
    parsed = parse_header(header)
    assert (parsed.opcode, parsed.request_id, parsed.payload_len) == (Opcode.DISPATCH, 9, 8 + 2 + 8)
    meta = decode_meta(body[: parsed.meta_len])
    assert meta == {
        "layer": 4, "mode": "exact", "combine": "f32",
        "tensors": [["x", "f32", "f32", [1, 2]], ["ids", "u8", "u8", [1, 2]], ["w", "f32", "f32", [1, 2]]],
    }
    assert body[: parsed.meta_len].hex() == (
        "84a56c6179657204a46d6f6465a56578616374a7636f6d62696e65a3663332a774656e736f727393"
        "94a178a3663332a3663332920102" "94a3696473a27538a2753892" "0102" "94a177a3663332a3663332920102"
    )
    assert body[parsed.meta_len :].hex() == "0000803f000000c0" "03ff" "0000003f0000803e"


def test_ids_travel_in_the_smallest_codec():
    for largest, codec in ((254, "u8"), (255, "i16"), (40000, "i32")):
        index = torch.tensor([[largest, -1]])
        frame = Dispatch(0, torch.zeros(1, 4), index, torch.ones(1, 2)).to_frame(1)
        assert frame.meta["tensors"][1][1] == codec
        assert torch.equal(Dispatch.from_frame(_reparse(frame)).top_k_index, index)


def test_dispatch_and_result_round_trip():
    hidden = torch.randn(3, 8)
    index = torch.tensor([[0, 5], [5, -1], [2, 0]])
    weights = torch.rand(3, 2)
    frame = Dispatch(2, hidden, index, weights).to_frame(1)
    again = Dispatch.from_frame(_reparse(frame))
    assert again.layer == 2 and torch.equal(again.hidden, hidden) and torch.equal(again.top_k_index, index)
    assert torch.equal(again.top_k_weights, weights)
    result = Result(2, CombineMode.EXACT, torch.randn(4, 8), [0, 5], [2, 2])
    back = Result.from_frame(_reparse(result.to_frame(1)))
    assert back.experts == [0, 5] and back.counts == [2, 2] and torch.equal(back.outputs, result.outputs)
    partial = Result(2, CombineMode.PARTIAL, torch.randn(3, 8), [], [], "bf16")
    back = Result.from_frame(_reparse(partial.to_frame(1)))
    assert "experts" not in partial.to_frame(1).meta and torch.equal(back.outputs, partial.outputs.bfloat16().float())
    assert back.cpu_s is None and "cpu_us" not in partial.to_frame(1).meta  # optional: older workers omit it


def test_a_result_says_its_experts_cpu_time_and_a_bad_one_is_named():
    result = Result(2, CombineMode.PARTIAL, torch.randn(1, 8), [], [])
    frame = result.to_frame(7, cpu_s=0.0012345)
    assert frame.meta["cpu_us"] == 1234
    assert Result.from_frame(_reparse(frame)).cpu_s == pytest.approx(0.001234)
    for bad in (-1, 1.5, "12", True, 1 << 41):
        frame.meta["cpu_us"] = bad
        with pytest.raises(ProtocolError, match="RESULT 'cpu_us' must be an integer"):
            Result.from_frame(_reparse(frame))


def test_a_dispatch_asks_for_timings_only_when_it_wants_them():
    request = Dispatch(0, torch.randn(1, 8), torch.tensor([[1, 2]]), torch.rand(1, 2))
    assert "t" not in request.to_frame(1).meta and not Dispatch.from_frame(_reparse(request.to_frame(1))).timed
    timed = Dispatch(0, request.hidden, request.top_k_index, request.top_k_weights, timed=True).to_frame(2)
    assert timed.meta["t"] is True and Dispatch.from_frame(_reparse(timed)).timed
    timed.meta["t"] = 1
    with pytest.raises(ProtocolError, match="DISPATCH field 't' must be true or false"):
        Dispatch.from_frame(_reparse(timed))


def test_hello_answer_golden_bytes_and_round_trip():
    """v2: HELLO's answer lists each layer's experts (any set), as [layer, [experts...]] pairs."""
    info = WorkerInfo("hf-abc", "qwen2_moe", 8, 32, {0: (0, 2, 3), 1: (5,)}, ("f32",))
    frame = info.to_frame(1)
    assert frame.meta["held"] == [[0, [0, 2, 3]], [1, [5]]]
    assert frame.to_bytes()[HEADER_SIZE:].hex() == (
        "87a870726f746f636f6c02ab66696e6765727072696e74a66866""2d616263"
        "aa6d6f64656c5f74797065a97177656e325f6d6f65ab6e756d5f65787065727473"
        "08ab68696464656e5f73697a6520a468656c6492920093000203920191" "05a6636f6465637391a3663332"
    )
    assert WorkerInfo.from_frame(_reparse(frame)) == info


def test_hello_answer_with_its_reply_bound_golden_bytes():
    """The worker's reply bound (--max-unsent-bytes) travels as an optional last field; absent, it is None."""
    info = WorkerInfo("hf-abc", "qwen2_moe", 8, 32, {0: (0, 2, 3), 1: (5,)}, ("f32",), 32 << 20)
    frame = info.to_frame(1)
    assert frame.to_bytes()[HEADER_SIZE:].hex() == (
        "88a870726f746f636f6c02ab66696e6765727072696e74a66866""2d616263"
        "aa6d6f64656c5f74797065a97177656e325f6d6f65ab6e756d5f65787065727473"
        "08ab68696464656e5f73697a6520a468656c6492920093000203920191" "05a6636f6465637391a3663332"
        "b06d61785f726573756c745f6279746573ce02000000"
    )
    assert WorkerInfo.from_frame(_reparse(frame)) == info
    for bad in (0, -1, "32M", True):
        with pytest.raises(ProtocolError, match="HELLO 'max_result_bytes' must be a positive integer"):
            WorkerInfo.from_frame(Frame(Opcode.HELLO, 1, {**frame.meta, "max_result_bytes": bad}))


@pytest.mark.parametrize(
    "held, message",
    [
        ([[0, [None]]], "HELLO layer 0: experts must be distinct ascending ids in 0-7"),
        ([[0, [1000]]], "HELLO layer 0: experts must be distinct ascending ids in 0-7"),
        ([[0, [-1]]], "HELLO layer 0: experts must be distinct ascending ids in 0-7"),
        ([[0, [3, 1]]], "HELLO layer 0: experts must be distinct ascending ids in 0-7"),
        ([[0, [1]], [0, [2]]], "HELLO lists layer 0 twice or out of range"),
        ([[0]], "HELLO 'held' entries must be [layer, [experts...]]"),
    ],
)
def test_malformed_hello_answers_are_named(held, message):
    meta = {**WorkerInfo("hf-abc", "m", 8, 32, {0: (0,)}, ("f32",)).to_frame(1).meta, "held": held}
    with pytest.raises(ProtocolError) as caught:
        WorkerInfo.from_frame(Frame(Opcode.HELLO, 1, meta))
    assert str(caught.value).startswith(message)


def _reparse(frame: Frame) -> Frame:
    data = frame.to_bytes()
    header = parse_header(data[:HEADER_SIZE])
    body = data[HEADER_SIZE:]
    return Frame(opcode_of(header), header.request_id, decode_meta(body[: header.meta_len]), body[header.meta_len :])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: b"XXXX" + h[4:], "bad magic"),
        (lambda h: h[:4] + b"\x01" + h[5:], "unsupported protocol version 1"),
        (lambda h: h[:16] + (2 << 20).to_bytes(4, "little") + h[20:], "metadata of 2097152 bytes is over the limit"),
        (lambda h: h[:20] + (1 << 31).to_bytes(4, "little"), "payload of 2147483648 bytes is over the limit"),
        (lambda h: h[:10], "truncated header: 10 of 24"),
    ],
)
def test_bad_headers_are_named(mutate, message):
    header = Frame(Opcode.PING, 1).to_bytes()[:HEADER_SIZE]
    with pytest.raises(ProtocolError, match=message):
        parse_header(mutate(header))


def test_unknown_opcode_and_bad_meta():
    header = parse_header(Frame(Opcode.PING, 1).to_bytes()[:HEADER_SIZE][:5] + b"\x63" + b"\x00" * 18)
    with pytest.raises(ProtocolError, match="unknown opcode 99"):
        opcode_of(header)
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode_meta(b"\xc1")
    with pytest.raises(ProtocolError, match="must be a map"):
        decode_meta(b"\x93\x01\x02\x03")


def test_error_reply_round_trip():
    frame = _reparse(ErrorReply("bad_request", "expert 9 is not held").to_frame(3))
    assert frame.opcode == Opcode.ERROR and ErrorReply.from_frame(frame).message == "expert 9 is not held"


def _dispatch_meta(**changes) -> Frame:
    frame = _reparse(Dispatch(0, torch.randn(2, 4), torch.tensor([[0, 1], [2, -1]]), torch.rand(2, 2)).to_frame(1))
    meta = {**frame.meta, **changes}
    return Frame(frame.opcode, frame.request_id, meta, frame.payload)


def _descriptor(meta, name, **fields):
    index = {"x": 0, "ids": 1, "w": 2}[name]
    tensors = [list(d) for d in meta["tensors"]]
    for field, value in fields.items():
        tensors[index][{"codec": 1, "dtype": 2, "shape": 3}[field]] = value
    return tensors


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: {"combine": "i32"}, "combine codec 'i32' cannot carry the experts' outputs (choose from f32, "),
        (lambda m: {"combine": "u8"}, "combine codec 'u8' cannot carry the experts' outputs"),
        (lambda m: {"tensors": _descriptor(m, "ids", dtype="f32")},
         "expert ids must be integers in their own codec (u8, i16, i32 or i64), got dtype 'f32' in codec 'u8'"),
        (lambda m: {"tensors": _descriptor(m, "ids", dtype="i64")},
         "expert ids must be integers in their own codec (u8, i16, i32 or i64), got dtype 'i64' in codec 'u8'"),
        (lambda m: {"tensors": _descriptor(m, "x", codec="i32")}, "DISPATCH tensor 'x' must travel in a float codec, got 'i32'"),
        (lambda m: {"tensors": _descriptor(m, "x", shape=[0, 2**31 - 1])}, "tensor 'x': shape [0, 2147483647] has no elements"),
        (lambda m: {"tensors": _descriptor(m, "w", codec=["f32"])}, "codec name must be a string, got list"),
        (lambda m: {"tensors": _descriptor(m, "w", dtype={"a": 1})}, "tensor 'w': unknown dtype {'a': 1}"),
        (lambda m: {"tensors": m["tensors"] + [m["tensors"][0]]}, "tensor 'x' is described twice"),
        (lambda m: {"tensors": m["tensors"] * 3}, "frame describes 9 tensors, over the limit of 8"),
    ],
    ids=["combine-i32", "combine-u8", "float-ids", "ids-dtype", "int-hidden", "empty-huge", "codec-type", "dtype-type",
         "twice", "too-many"],
)
def test_stricter_dispatch_checks_are_named(change, message):
    frame = _dispatch_meta()
    frame = _dispatch_meta(**change(frame.meta))
    with pytest.raises(ProtocolError) as caught:
        Dispatch.from_frame(frame)
    assert str(caught.value).startswith(message), str(caught.value)
