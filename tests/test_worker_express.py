"""The express lane (worker/express.py): a DISPATCH with metadata bytes answered before, answered in one
C call from the frame's bytes, with the bits and the RESULT frame of the full path.

Frames go through the real encoder and decoder (to_frame, bytes, parse_header, decode_frame) into
the worker's Computation over a store of quantized experts (random Q4_K blocks, test_quant_experts).
"""

from __future__ import annotations

import torch

from moeswarm.ids import LayerId
from moeswarm.model.hosted import HostedLayer
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Opcode, parse_header
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


def test_known_metadata_is_answered_in_one_c_call_with_the_full_paths_bits_and_frame():
    """Per store (every expert; experts 2-4 with the others' slots -1), token count and timing: the
    first DISPATCH goes the full path, the next ones with the same metadata and new values the express
    lane; every RESULT decodes to the store's own answer, bit for bit, under the same metadata."""
    for held in ((0, 1, 2, 3, 4), (2, 3, 4)):
        store = store_of(held)
        computation = Computation(store, WorkerLimits())
        for tokens, k, timed in ((1, 3, False), (4, 3, True)):
            before = computation.express.answered
            for seed in range(4):
                hidden, index, weights = routing(tokens, k, held, seed)
                request = Dispatch(0, hidden, index, weights, CombineMode.PARTIAL, timed=timed)
                reply = computation.one(received(request))
                assert reply.opcode == Opcode.RESULT
                result = Result.from_frame(decode_frame(*_parsed(reply)))
                expected = store.run(request)
                assert torch.equal(result.outputs, expected.outputs)
                assert (result.layer, result.mode) == (0, CombineMode.PARTIAL)
                assert {key for key in reply.meta if key != "cpu_us"} == {"layer", "mode", "tensors"}
                assert ("cpu_us" in reply.meta) == timed
            assert computation.express.answered == before + 3  # all but the first of each metadata


def test_values_the_table_refuses_go_the_full_path_and_are_named():
    """After the lane is known: an expert held elsewhere, an id out of range and a DISPATCH routing no
    slot here are each answered ERROR by the full path's checks, and the lane goes on serving."""
    held = (2, 3, 4)
    store = store_of(held)
    computation = Computation(store, WorkerLimits())
    hidden, index, weights = routing(1, 3, held, 0)
    computation.one(received(Dispatch(0, hidden, index, weights, CombineMode.PARTIAL)))
    for bad, message in ((1, "expert 1 of layer 0 is not held by this worker"),
                         (200, "expert id 200 out of range"),
                         (-1, "routes no token to any expert")):
        ids = torch.full_like(index, -1)
        ids[0, 0] = bad
        reply = computation.one(received(Dispatch(0, hidden, ids, weights, CombineMode.PARTIAL)))
        assert reply.opcode == Opcode.ERROR and message in ErrorReply.from_frame(reply).message
    answered = computation.express.answered
    reply = computation.one(received(Dispatch(0, hidden, index, weights, CombineMode.PARTIAL)))
    assert torch.equal(Result.from_frame(decode_frame(*_parsed(reply))).outputs,
                       store.run(Dispatch(0, hidden, index, weights, CombineMode.PARTIAL)).outputs)
    assert computation.express.answered == answered + 1


def test_exact_and_reduced_wire_dispatches_never_take_the_lane():
    """Exact mode (rows per pair) and a bf16 dispatch codec go the full path every time."""
    held = (0, 1, 2, 3, 4)
    store = store_of(held)
    computation = Computation(store, WorkerLimits())
    for mode, codec in ((CombineMode.EXACT, "f32"), (CombineMode.PARTIAL, "bf16")):
        for seed in range(3):
            hidden, index, weights = routing(2, 3, held, seed)
            request = Dispatch(0, hidden, index, weights, mode, wire_dispatch=codec)
            reply = computation.one(received(request))
            assert reply.opcode == Opcode.RESULT
    assert computation.express.answered == 0


def _parsed(frame):
    data = b"".join(bytes(part) for part in frame.encode())
    return parse_header(data[:HEADER_SIZE]), data[HEADER_SIZE:]
