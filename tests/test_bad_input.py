"""Bad input to a worker: each case gets an ERROR reply naming the cause, and the worker goes on.

The worker is a real `moeswarm worker` process; frames are written by hand on raw sockets.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.ids import parse_address
from moeswarm.sources.source import open_source
from moeswarm.placement.table import build_table
from moeswarm.swarm import open_swarm
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.frames import HEADER, HEADER_SIZE, MAGIC, VERSION, Frame, Opcode, decode_meta, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello


def _connect(address: str) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=30)
    return sock


def _read_frame(sock: socket.socket) -> Frame:
    head = _read_exact(sock, HEADER_SIZE)
    header = parse_header(head)
    body = _read_exact(sock, header.body_len)
    return Frame(Opcode(header.opcode), header.request_id, decode_meta(body[: header.meta_len]), body[header.meta_len :])


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def _greeted(address: str, fingerprint: str) -> socket.socket:
    sock = _connect(address)
    sock.sendall(Hello(fingerprint).to_frame(1).to_bytes())
    assert _read_frame(sock).opcode == Opcode.HELLO
    return sock


def _expect_error(sock: socket.socket, *fragments: str) -> str:
    reply = _read_frame(sock)
    assert reply.opcode == Opcode.ERROR, reply
    message = ErrorReply.from_frame(reply).message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _still_serves(address: str, fingerprint: str) -> None:
    """A fresh connection gets a real RESULT: the worker survived."""
    sock = _greeted(address, fingerprint)
    good = Dispatch(1, torch.randn(1, 32), torch.tensor([[0, 2]]), torch.rand(1, 2))
    sock.sendall(good.to_frame(5).to_bytes())
    assert _read_frame(sock).opcode == Opcode.RESULT
    sock.close()


@pytest.fixture(scope="module")
def worker(qwen2_moe, qwen2_workers):
    """(address of the worker holding experts 0-3, model fingerprint)."""
    return qwen2_workers[0], open_source(qwen2_moe).fingerprint


def _dispatch_bytes(request_id=2, **changes) -> bytes:
    request = Dispatch(1, torch.randn(2, 32), torch.tensor([[0, 1], [3, -1]]), torch.rand(2, 2))
    return dataclasses.replace(request, **changes).to_frame(request_id).to_bytes()


def test_truncated_frame(worker):
    address, fingerprint = worker
    sock = _greeted(address, fingerprint)
    data = _dispatch_bytes()
    sock.sendall(data[: len(data) - 10])
    sock.shutdown(socket.SHUT_WR)
    _expect_error(sock, "truncated frame")
    _still_serves(address, fingerprint)


def test_frame_over_size_limit(worker):
    address, fingerprint = worker
    sock = _greeted(address, fingerprint)
    sock.sendall(HEADER.pack(MAGIC, VERSION, Opcode.DISPATCH, 0, 3, 10, 2**31))
    _expect_error(sock, "over the limit")
    _still_serves(address, fingerprint)


def test_bad_magic(worker):
    address, fingerprint = worker
    sock = _connect(address)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    _expect_error(sock, "bad magic")
    _still_serves(address, fingerprint)


def test_unknown_opcode_keeps_the_connection(worker):
    address, fingerprint = worker
    sock = _greeted(address, fingerprint)
    sock.sendall(HEADER.pack(MAGIC, VERSION, 99, 0, 4, 1, 0) + b"\x80")
    _expect_error(sock, "unknown opcode 99")
    sock.sendall(Frame(Opcode.PING, 6).to_bytes())
    assert _read_frame(sock).opcode == Opcode.PONG


def _with_meta(data: bytes, edit) -> bytes:
    """Rewrite a frame's metadata with `edit(meta)`, fixing the header's length."""
    magic, version, opcode, flags, rid, meta_len, payload_len = HEADER.unpack(data[:HEADER_SIZE])
    meta = decode_meta(data[HEADER_SIZE : HEADER_SIZE + meta_len])
    edit(meta)
    import msgpack

    packed = msgpack.packb(meta)
    return HEADER.pack(magic, version, opcode, flags, rid, len(packed), payload_len) + packed + data[HEADER_SIZE + meta_len :]


@pytest.mark.parametrize(
    "make, fragments",
    [
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m["tensors"][0].__setitem__(1, "q3")), ["unknown codec 'q3'"]),
        (lambda: _dispatch_bytes(layer=99), ["layer 99 is not served"]),
        (lambda: _dispatch_bytes(top_k_index=torch.tensor([[0, 6], [3, -1]])), ["expert 6 of layer 1 is not held", "0-3"]),
        (lambda: _dispatch_bytes(top_k_index=torch.tensor([[0, 1], [300, -1]])), ["expert id 300 out of range"]),
        (lambda: _dispatch_bytes(hidden=torch.randn(2, 31)), ["hidden size 31 does not match"]),
        (lambda: _dispatch_bytes(hidden=torch.randn(2, 32, dtype=torch.bfloat16)), ["dtype mismatch"]),
        (lambda: _dispatch_bytes(top_k_weights=torch.rand(3, 2)), ["shapes do not match"]),
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m["tensors"][0].__setitem__(3, [2, 64])), ["needs 512 bytes"]),
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m["tensors"][1].__setitem__(2, "f64")), ["unknown dtype 'f64'"]),
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m.update(mode="fancy")), ["unknown combine mode 'fancy'"]),
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m.update(combine="zip")), ["unknown codec 'zip'"]),
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m.pop("layer")), ["'layer' missing"]),
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m.update(combine="i32")),
         ["combine codec 'i32' cannot carry the experts' outputs"]),
        (lambda: _dispatch_bytes(top_k_index=torch.tensor([[0] + [-1] * 64, [3] + [-1] * 64]),
                                 top_k_weights=torch.rand(2, 65)),
         ["DISPATCH tensor 'ids' has top-k 65, over the model's top-k of 2"]),  # the tiny model routes top-2
        (lambda: _with_meta(_dispatch_bytes(), lambda m: m["tensors"][0].__setitem__(3, [0, 2**31 - 1])),
         ["tensor 'x': shape [0, 2147483647] has no elements"]),
    ],
    ids=["codec", "layer", "expert", "expert-range", "shape", "dtype", "routing-shape", "length", "index-dtype", "mode",
         "combine-codec", "field", "integer-combine", "top-k", "zero-size"],
)
def test_bad_dispatch_gets_error_and_connection_lives(worker, make, fragments):
    address, fingerprint = worker
    sock = _greeted(address, fingerprint)
    sock.sendall(make())
    _expect_error(sock, *fragments)
    sock.sendall(_dispatch_bytes(request_id=8))  # same connection, good request
    assert _read_frame(sock).opcode == Opcode.RESULT
    sock.close()


def test_wrong_fingerprint_is_refused(worker):
    address, fingerprint = worker
    sock = _connect(address)
    sock.sendall(Hello("hf-0000").to_frame(1).to_bytes())
    _expect_error(sock, "fingerprint mismatch", fingerprint, "hf-0000")
    _still_serves(address, fingerprint)


def test_dispatch_before_hello(worker):
    address, fingerprint = worker
    sock = _connect(address)
    sock.sendall(_dispatch_bytes())
    _expect_error(sock, "DISPATCH before HELLO")


def test_backbone_names_worker_of_another_model(tiny_models, qwen2_workers):
    other = tiny_models("olmoe")
    with pytest.raises(WorkerError, match=rf"worker {qwen2_workers[0]}: model fingerprint mismatch"):
        open_swarm(other, qwen2_workers)


def test_backbone_names_worker_that_is_down(qwen2_moe, qwen2_workers):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(WorkerError, match=rf"worker {dead}: cannot connect"):
        open_swarm(qwen2_moe, [qwen2_workers[0], dead])


def _dispatcher(qwen2_moe, addresses, claims):
    """A dispatcher whose placement believes `claims` ({link index: experts of layer 1}), not the HELLOs."""
    fingerprint = open_source(qwen2_moe).fingerprint
    links = [TcpLink(address) for address in addresses]
    for link in links:
        link.connect(fingerprint)
    return Dispatcher(links, build_table({i: {1: experts} for i, experts in claims.items()}, 8))


def test_backbone_names_worker_and_cause_of_an_error_reply(qwen2_moe, qwen2_workers):
    dispatcher = _dispatcher(qwen2_moe, qwen2_workers[:1], {0: range(8)})  # claims experts it does not hold
    with pytest.raises(WorkerError) as caught:
        dispatcher.combine(dispatcher.dispatch(1, torch.randn(1, 32), torch.tensor([[5, 0]]), torch.rand(1, 2)))
    assert str(caught.value) == (f"worker {qwen2_workers[0]}: expert 5 of layer 1 is not held by this worker "
                                 "(it holds experts 0-3); layer 1 experts 0,5 have no other usable holder")
    dispatcher.close()


def test_missing_experts_are_refused_and_duplicates_accepted(qwen2_moe, qwen2_workers):
    with pytest.raises(MoeSwarmError) as caught:
        open_swarm(qwen2_moe, qwen2_workers[:1])
    assert str(caught.value) == "no worker holds layer 0 experts 4-7; layer 1 experts 4-7; layer 2 experts 4-7"
    # Two links to the same worker hold the same experts: the table keeps both, the first is used.
    with open_swarm(qwen2_moe, [qwen2_workers[0], qwen2_workers[0], qwen2_workers[1]]) as swarm:
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        logits = swarm.model(input_ids=ids).logits
        summary = swarm.accounting()
    assert torch.isfinite(logits).all()
    assert list(summary["worker_rtt_ms_mean"]) == sorted({qwen2_workers[0], qwen2_workers[1]})


def test_other_workers_stay_usable_after_one_fails(qwen2_moe, qwen2_workers):
    # Link 0 (experts 4-7) is made to claim expert 3 too, and link 1 (experts 0-3) to give it up:
    # link 0 answers ERROR, link 1 a RESULT that must still be read so its stream stays in step.
    dispatcher = _dispatcher(qwen2_moe, [qwen2_workers[1], qwen2_workers[0]], {0: [3, 4, 5, 6, 7], 1: [0, 1, 2]})
    hidden, weights = torch.randn(1, 32), torch.rand(1, 2)
    with pytest.raises(WorkerError) as caught:
        dispatcher.combine(dispatcher.dispatch(1, hidden, torch.tensor([[0, 3]]), weights))
    assert str(caught.value).startswith(f"worker {qwen2_workers[1]}: expert 3 of layer 1 is not held")
    out = dispatcher.combine(dispatcher.dispatch(1, hidden, torch.tensor([[0, 5]]), weights))  # both streams in step
    assert out.shape == (1, 32) and torch.isfinite(out).all()
    assert not any(link.broken for link in dispatcher.links)
    dispatcher.close()
