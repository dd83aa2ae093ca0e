"""Every way a layer call goes gives the same bits: the same frames through every path, on each side.

Backbone (dispatch/paths.py): the lane (in C), express and a flight, asked in that order in one
place (`Dispatcher._send`); a test makes a call take one of them by leaving the ones before it out
of `Dispatcher.call_paths`. Worker (worker/answerers.py): compute (the full path), express (as a frame on
the compute thread, and whole on the loop) and the hold (a held connection answered in C), for
each lane kind (quantized experts in C, float ones by torch), the frames' bytes compared.

Quantized experts (random Q4_K blocks, test_quant_experts) over in-process WorkerServers on real
TCP, and fake workers (test_dispatcher's) where only the backbone's paths are compared.
"""

from __future__ import annotations

import contextlib
import selectors
import socket

import pytest
import torch
from test_dispatcher import E, FakeWorker, _routing, reference, tcp_dispatcher
from test_worker_express import _parsed, received, routing, store_of
from test_worker_limits import FINGERPRINT, greeted, recv
from test_worker_runner import running

from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.dispatch.paths import Outcome
from moeswarm.placement.table import build_table
from moeswarm.transport import token_call
from moeswarm.transport.tcp import TcpLink
from moeswarm.kernels import qkernels
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Opcode, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Result
from moeswarm.wire.stream import decode_frame, send_frame
from moeswarm.worker.compute import Computation
from moeswarm.worker.config import INLINE_TOKENS
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.server import WorkerServer
from test_quant_experts import random_experts

PATHS = ("lane", "express", "flight")  # the backbone's, in the order the dispatcher asks them
quantized = pytest.mark.skipif(qkernels._library() is None, reason="moeswarm's C kernels are not built")


def only_from(dispatcher: Dispatcher, name: str) -> Dispatcher:
    """`dispatcher` asking its paths from `name` on (the ones before it left out)."""
    names = [path.name for path in dispatcher.call_paths]
    dispatcher.call_paths = dispatcher.call_paths[names.index(name):]
    return dispatcher


def path_names() -> tuple[str, ...]:
    """The backbone paths this host has: the lane needs moeswarm's C layer call."""
    return PATHS if token_call.available() else PATHS[1:]


def test_the_dispatcher_asks_each_path_in_turn_and_the_outcomes_are_an_enum():
    workers = [FakeWorker(list(range(E)))]
    dispatcher = tcp_dispatcher(workers)
    try:
        assert [path.name for path in dispatcher.call_paths] == list(PATHS)
        assert dispatcher.call_paths[0] is dispatcher.lane and dispatcher.call_paths[-1].eligible(None)
        assert {outcome.name for outcome in Outcome} == {"UNFIT", "FAILED"}
    finally:
        dispatcher.close()
        workers[0].close()


def test_every_backbone_path_gives_eager_s_bits_for_the_same_calls():
    """Holders of expert ranges (a token's experts never interleave between them, so the lane may
    take it): each one-token call through the lane, express and a flight, with eager's bits."""
    workers = [FakeWorker(list(range(E // 2))), FakeWorker(list(range(E // 2, E)))]
    dispatchers = {name: only_from(tcp_dispatcher(workers), name) for name in path_names()}
    try:
        for dispatcher in dispatchers.values():
            dispatcher.owners.of(0)  # planned once: the layer has no replicas (the lane needs to know)
        for seed in range(12):
            hidden, index, weights = _routing(1, seed)
            expected = reference(hidden, index, weights)
            for name, dispatcher in dispatchers.items():
                handle = dispatcher.dispatch(0, hidden, index, weights)
                assert handle.path.name == name
                assert torch.equal(dispatcher.combine(handle), expected), name
        if "lane" in dispatchers:
            assert (dispatchers["lane"].lane.calls, dispatchers["lane"].lane.demotions) == (12, 0)
        for name, dispatcher in dispatchers.items():
            calls = dispatcher.accounting.calls
            assert len(calls) == 12 and all(call.in_c == (name == "lane") for call in calls)
    finally:
        for dispatcher in dispatchers.values():
            dispatcher.close()
        for worker in workers:
            worker.close()


def _frame(request: Dispatch, request_id: int) -> tuple:
    """(header, body) of `request` as the worker reads it."""
    return _parsed(request.to_frame(request_id))


def _bits(reply) -> tuple[torch.Tensor, list, list]:
    """A RESULT (a Frame, or a whole frame's bytes): (outputs, experts, counts)."""
    if not hasattr(reply, "opcode"):
        data = bytes(reply)
        reply = decode_frame(parse_header(data[:HEADER_SIZE]), data[HEADER_SIZE:])
    else:
        reply = decode_frame(*_parsed(reply))
    assert reply.opcode == Opcode.RESULT, ErrorReply.from_frame(reply).message
    result = Result.from_frame(reply)
    return result.outputs, result.experts, result.counts


def _same(got, expected) -> None:
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


@quantized
@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_every_worker_answerer_gives_the_full_path_s_bits_for_the_same_frames(mode):
    """The same DISPATCH frames answered by the full path (compute), by express as a frame and whole,
    and by a held connection: each RESULT's rows, experts and counts the same bits."""
    held = (0, 1, 2, 3, 4) if mode == CombineMode.PARTIAL else (2, 3, 4)
    requests = [Dispatch(0, *routing(1, 3, held, seed), mode) for seed in range(8)]
    full = Computation(store_of(held), WorkerLimits())
    expected = [_bits(full.answer(received(request, 30 + i))) for i, request in enumerate(requests)]

    taught = Computation(store_of(held), WorkerLimits())
    assert taught.one(received(requests[0], 30)).opcode == Opcode.RESULT  # the full path: express learns the lane
    for i, request in enumerate(requests):
        _same(_bits(taught.express.answer(received(request, 30 + i))), expected[i])  # express, a frame
        header, body = _frame(request, 30 + i)
        lane = taught.express.whole_lane(body, header.meta_len)
        assert lane is not None
        _same(_bits(taught.express.answer_now(lane, body, 30 + i)), expected[i])  # express, whole
    assert taught.express.answered == 2 * len(requests)

    server = WorkerServer(store_of(held), FINGERPRINT, "scale", WorkerLimits(), inline_tokens=8)
    with running(server) as (_, address):
        sock = greeted(address)
        for i, request in enumerate(requests):  # the first goes the full path, the next whole on the loop, then held
            send_frame(sock, request.to_frame(30 + i))
            reply = recv(sock)
            assert reply.request_id == 30 + i
            _same(_bits(reply), expected[i])
        sock.close()
    express = server.computation.express
    assert express.whole == len(requests) - 1 and express.hold.answered >= 1


def _frame_bytes(reply) -> bytes:
    """A reply's whole frame (header, metadata, payload) as bytes: a Frame encoded, or a whole frame as is."""
    return bytes(reply) if not hasattr(reply, "opcode") else b"".join(bytes(part) for part in reply.encode())


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the held connection closed"
        data += chunk
    return data


def _held_replies(computation: Computation, frames: list[bytes]) -> tuple[list[bytes], int]:
    """The whole RESULT frames a held connection (worker/hold.py) sends for `frames`, all sent before
    the hold begins on one end of a socket pair (the loop's selector one that is never ready), and
    how many of them were answered in C. Holds go on while each answers some (one ends after
    HOLD_LIMIT_S)."""
    held, peer = socket.socketpair()
    held.setblocking(False)  # as the loop's connections are
    peer.settimeout(10.0)
    with held, peer, selectors.DefaultSelector() as never_ready:
        peer.sendall(b"".join(frames))
        answered = in_c = 0
        while answered < len(frames):
            did = computation.express.hold.serve(held.fileno(), never_ready.fileno(), INLINE_TOKENS)
            assert did.answered and not did.pending and not did.unsent
            answered, in_c = answered + did.answered, in_c + did.in_c
        replies = []
        for _ in frames:
            header = _read_exactly(peer, HEADER_SIZE)
            parsed = parse_header(header)
            replies.append(header + _read_exactly(peer, parsed.meta_len + parsed.payload_len))
    return replies, in_c


def _float_store(model: str):
    from test_worker_torch_lane import store_of as float_store_of

    return float_store_of(model, list(range(8)))


@pytest.mark.parametrize("experts", ["quantized", "float"])
@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_every_worker_answerer_gives_the_same_frame_bytes_for_the_same_frames(experts, mode, tiny_models):
    """The same DISPATCH frames through each of the worker's answerers (the chain: hold, express,
    compute), for each lane kind (quantized experts: `QuantLane`, in C; float ones: `TorchLane`, the
    partial ones' `OneCall`): every RESULT frame the same bytes, header, metadata and payload."""
    if experts == "quantized":
        if qkernels._library() is None:
            pytest.skip("moeswarm's C kernels are not built")
        held = (0, 1, 2, 3, 4)

        def make_store():
            return store_of(held)

        calls = [routing(1, 3, held, seed) for seed in range(8)]
    else:
        from test_worker_torch_lane import routing as float_routing

        def make_store():
            return _float_store(tiny_models("qwen2_moe"))

        store = make_store()
        calls = [float_routing(store, 1, list(range(8)), seed) for seed in range(8)]
    requests = [Dispatch(0, *call, mode) for call in calls]
    rids = [50 + i for i in range(len(requests))]
    full = Computation(make_store(), WorkerLimits())
    compute = [_frame_bytes(full.answer(received(request, rid))) for request, rid in zip(requests, rids)]
    assert all(parse_header(reply[:HEADER_SIZE]).opcode == Opcode.RESULT for reply in compute)

    taught = Computation(make_store(), WorkerLimits())
    assert [answerer.name for answerer in taught.answerers.chain] == ["hold", "express", "compute"]
    taught.one(received(requests[0], 49))  # the full path: express learns the lane, the hold holds it
    by_path = {"express": [], "express, whole": []}
    for request, rid in zip(requests, rids):
        by_path["express"].append(_frame_bytes(taught.express.answer(received(request, rid))))
        header, body = _frame(request, rid)
        lane = taught.express.whole_lane(body, header.meta_len)
        by_path["express, whole"].append(_frame_bytes(taught.express.answer_now(lane, body, rid)))
    frames = [_frame_bytes(request.to_frame(rid)) for request, rid in zip(requests, rids)]
    by_path["hold"], in_c = _held_replies(taught, frames)
    assert in_c == (len(frames) if experts == "quantized" else 0)  # float experts: answered by `answer_now`
    for name, replies in by_path.items():
        assert replies == compute, name
    assert taught.express.hold.answered == len(requests)
    assert taught.express.answered == 3 * len(requests) - in_c  # `answer_now` counts its own; HeldConnection the C's


@contextlib.contextmanager
def quantized_workers(ranges: list[tuple[int, ...]]):
    """Dispatchers' links to in-process WorkerServers holding these ranges of the same quantized experts."""
    with contextlib.ExitStack() as stack:
        servers = [WorkerServer(store_of(held), FINGERPRINT, "scale", WorkerLimits(), inline_tokens=8)
                   for held in ranges]
        addresses = ["%s:%d" % stack.enter_context(running(server))[1] for server in servers]

        def dispatcher() -> Dispatcher:
            links = [TcpLink(address) for address in addresses]
            for link in links:
                link.connect(FINGERPRINT)
            made = Dispatcher(links, build_table({i: link.info.held for i, link in enumerate(links)}, 5))
            made.verification.gate.bootstrap = 1e12  # random blocks: rows far larger than a trained layer's
            stack.callback(made.close)
            made.owners.of(0)
            return made

        yield servers, dispatcher


@quantized
def test_a_decode_s_calls_give_the_same_bits_whichever_path_on_either_side():
    """A decode's one-token calls to two workers (experts 0-1 and 2-4 of the same quantized layer)
    through each backbone path in turn, each answered by whichever worker answerer takes it (the full
    path first, then whole on the loop, then held): every output the same bits, the layer's own (its
    experts module over the whole layer)."""
    module = random_experts("silu")
    calls = []
    for seed in range(10):
        torch.manual_seed(seed)
        calls.append((torch.randn(1, 512), torch.randperm(5)[:3].view(1, 3), torch.rand(1, 3)))
    with torch.no_grad():
        expected = [module(*call) for call in calls]
    with quantized_workers([(0, 1), (2, 3, 4)]) as (servers, dispatcher):
        for name in path_names():  # one path's calls after another: a connection is held between its calls
            each = only_from(dispatcher(), name)
            for seed, call in enumerate(calls):
                handle = each.dispatch(0, *call)
                assert handle.path.name == name
                assert torch.equal(each.combine(handle), expected[seed]), (name, seed)
        answered = [server.computation.express for server in servers]
        assert all(express.whole > 0 and express.hold.answered > 0 for express in answered)
