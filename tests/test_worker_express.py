"""The express lane (worker/express_answer.py): a DISPATCH with metadata bytes answered before, answered in one
C call from the frame's bytes, with the bits and the RESULT frame of the full path.

Frames go through the real encoder and decoder (to_frame, bytes, parse_header, decode_frame) into
the worker's Computation over a store of quantized experts (random Q4_K blocks, test_quant_experts).
"""

from __future__ import annotations

import pytest
import torch

from moeswarm.ids import LayerId
from moeswarm.model.hosted import HostedLayer
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Opcode, pack_meta, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Result
from moeswarm.wire.stream import decode_frame
from moeswarm.worker.compute import Computation
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.store import ExpertStore
from test_quant_experts import random_experts


def received(request: Dispatch, request_id: int = 7):
    """`request` as the worker receives it: encoded, sent as bytes, decoded."""
    data = b"".join(bytes(part) for part in request.to_frame(request_id).encode())
    return decode_frame(parse_header(data[:HEADER_SIZE]), data[HEADER_SIZE:])


def store_of(held: tuple[int, ...]) -> ExpertStore:
    module = random_experts("silu")
    part = module.narrow(held[0], held[-1] + 1)
    return ExpertStore({LayerId(0): HostedLayer(LayerId(0), held, part)}, num_experts=5, hidden_size=512)


def routing(tokens: int, k: int, held: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, 512], ids [T, k] (-1 for experts held elsewhere, each token routed here), weights [T, k]."""
    torch.manual_seed(seed)
    index = torch.stack([torch.randperm(5)[:k] for _ in range(tokens)])
    index = torch.where(index >= held[0], index, -1)
    index[:, 0] = held[-1]
    return torch.randn(tokens, 512), index, torch.rand(tokens, k)


@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_known_metadata_is_answered_in_one_c_call_with_the_full_paths_bits_and_frame(mode):
    """Per store (every expert; experts 2-4 with the others' slots -1), token count and timing: the
    first DISPATCH goes the full path, the next ones with the same metadata and new values the express
    lane; every RESULT decodes to the store's own answer, bit for bit (partial: each token's sum;
    exact: each pair's row, and the same experts and counts), with the full path's metadata fields."""
    for held in ((0, 1, 2, 3, 4), (2, 3, 4)):
        store = store_of(held)
        computation = Computation(store, WorkerLimits())
        for tokens, k, timed in ((1, 3, False), (4, 3, True)):
            before = computation.express.answered
            for seed in range(4):
                hidden, index, weights = routing(tokens, k, held, seed)
                request = Dispatch(0, hidden, index, weights, mode, timed=timed)
                reply = computation.one(received(request))
                assert reply.opcode == Opcode.RESULT
                result = Result.from_frame(decode_frame(*_parsed(reply)))
                expected = store.run(request)
                assert torch.equal(result.outputs, expected.outputs)
                assert (result.layer, result.mode) == (0, mode)
                if mode == CombineMode.EXACT:
                    assert (result.experts, result.counts) == (expected.experts, expected.counts)
                assert list(reply.meta) == list(expected.to_frame(7, 0.0 if timed else None).meta)
            assert computation.express.answered == before + 3  # all but the first of each metadata


@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_values_the_table_refuses_go_the_full_path_and_are_named(mode):
    """After the lane is known: an expert held elsewhere, an id out of range and a DISPATCH routing no
    slot here are each answered ERROR by the full path's checks, and the lane goes on serving."""
    held = (2, 3, 4)
    store = store_of(held)
    computation = Computation(store, WorkerLimits())
    hidden, index, weights = routing(1, 3, held, 0)
    computation.one(received(Dispatch(0, hidden, index, weights, mode)))
    for bad, message in ((1, "expert 1 of layer 0 is not held by this worker"),
                         (200, "expert id 200 out of range"),
                         (-1, "routes no token to any expert")):
        ids = torch.full_like(index, -1)
        ids[0, 0] = bad
        reply = computation.one(received(Dispatch(0, hidden, ids, weights, mode)))
        assert reply.opcode == Opcode.ERROR and message in ErrorReply.from_frame(reply).message
    answered = computation.express.answered
    reply = computation.one(received(Dispatch(0, hidden, index, weights, mode)))
    assert torch.equal(Result.from_frame(decode_frame(*_parsed(reply))).outputs,
                       store.run(Dispatch(0, hidden, index, weights, mode)).outputs)
    assert computation.express.answered == answered + 1


def test_reduced_wire_dispatches_never_take_the_lane():
    """A bf16 dispatch codec and a bf16 combine codec go the full path every time."""
    held = (0, 1, 2, 3, 4)
    store = store_of(held)
    computation = Computation(store, WorkerLimits())
    for dispatch_codec, combine_codec in (("bf16", "f32"), ("f32", "bf16")):
        for seed in range(3):
            hidden, index, weights = routing(2, 3, held, seed)
            request = Dispatch(0, hidden, index, weights, CombineMode.PARTIAL, dispatch_codec, combine_codec)
            reply = computation.one(received(request))
            assert reply.opcode == Opcode.RESULT
    assert computation.express.answered == 0


def _parsed(frame):
    data = b"".join(bytes(part) for part in frame.encode())
    return parse_header(data[:HEADER_SIZE]), data[HEADER_SIZE:]


@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_a_decode_step_s_dispatch_is_answered_whole_in_c_on_the_event_loop(mode):
    """Over real TCP to an in-process WorkerServer: after the first DISPATCH of each metadata (the full
    path), each next one is answered from its frame's bytes with the whole RESULT frame made in C,
    sent from the loop: the frame's bytes are the full path's (timed: but for its CPU time), the
    outputs the store's own, bit for bit. Exact: a worker holding experts 2-4 (ids in the RESULT
    are the model's), with one or two of them routed."""
    from test_worker_limits import greeted, recv
    from test_worker_runner import running

    from moeswarm.wire.stream import send_frame
    from moeswarm.worker.server import WorkerServer

    held = (0, 1, 2, 3, 4) if mode == CombineMode.PARTIAL else (2, 3, 4)
    store = store_of(held)
    server = WorkerServer(store, "hf-limits01", "scale", WorkerLimits(), inline_tokens=8)
    reference = Computation(store_of(held), WorkerLimits())  # the full path's frames, for the same requests
    with running(server) as (_, address):
        sock = greeted(address)
        for timed in (False, True):
            for seed in range(4):
                hidden, index, weights = routing(1, 3, held, seed)
                request = Dispatch(0, hidden, index, weights, mode, timed=timed)
                send_frame(sock, request.to_frame(20 + seed))
                reply = recv(sock)
                assert (reply.opcode, reply.request_id) == (Opcode.RESULT, 20 + seed), ErrorReply.from_frame(reply)
                full = reference.one(received(request, 20 + seed))
                result, expected = Result.from_frame(reply), store.run(request)
                assert torch.equal(result.outputs, expected.outputs)
                if mode == CombineMode.EXACT:
                    assert (result.experts, result.counts) == (expected.experts, expected.counts)
                if timed:
                    assert list(reply.meta) == list(full.meta) and reply.payload == b"".join(full.parts)
                    assert {key: value for key, value in reply.meta.items() if key != "cpu_us"} == \
                        {key: value for key, value in full.meta.items() if key != "cpu_us"}
                else:
                    assert reply.meta_bytes == pack_meta(full.meta) and reply.payload == b"".join(full.parts)
        sock.close()
    assert server.computation.express.whole == 6  # all but the first of each metadata


def test_a_connection_served_only_by_whole_frames_in_c_is_not_idle():
    """Frames answered in the transport's callback (worker/server.py `_whole_frame`) count as activity:
    with a 1 s idle timeout, DISPATCHes every 0.25 s for 2 s keep the connection open."""
    import time

    from test_worker_limits import greeted, recv
    from test_worker_runner import running

    from moeswarm.wire.stream import send_frame
    from moeswarm.worker.server import WorkerServer

    held = (0, 1, 2, 3, 4)
    server = WorkerServer(store_of(held), "hf-limits01", "scale", WorkerLimits(idle_timeout_s=1.0), inline_tokens=8)
    with running(server) as (_, address):
        sock = greeted(address)
        for seed in range(9):
            hidden, index, weights = routing(1, 3, held, seed)
            send_frame(sock, Dispatch(0, hidden, index, weights, CombineMode.PARTIAL).to_frame(50 + seed))
            reply = recv(sock)
            assert (reply.opcode, reply.request_id) == (Opcode.RESULT, 50 + seed), ErrorReply.from_frame(reply).message
            time.sleep(0.25)
        sock.close()
    assert server.computation.express.whole == 8
