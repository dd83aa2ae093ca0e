"""Float experts on the express lane (worker/torch_lane.py `TorchLane`) and the eager modules' own sums
(worker/store.py `_sentinel`): a decode step's DISPATCH to a family's torch experts skips the full
path's decoding and queueing, with the full path's RESULT frame and bits.

Frames go through the real encoder and decoder into the worker's Computation over a store of a tiny
model's experts (transformers' eager classes), and over real TCP to an in-process WorkerServer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeswarm.sources.loading import load_experts
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Opcode, pack_meta, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Result
from moeswarm.wire.stream import decode_frame
from moeswarm.worker.compute import Computation
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.store import ExpertStore, _by_token, _pairs, _sentinel
from test_worker_express import _parsed, received

EXPERTS = 8  # the tiny models' routed experts per layer


def store_of(model: str, held: list[int]) -> ExpertStore:
    hosted, source, num_experts = load_experts(model, held, None)
    return ExpertStore(hosted, num_experts, source.config.hidden_size)


def routing(store: ExpertStore, tokens: int, held: list[int], seed: int):
    """hidden [T, d], ids [T, 3] (-1 for experts held elsewhere, each token routed here), weights [T, 3]."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:3] for _ in range(tokens)])
    index = torch.where(torch.isin(index, torch.tensor(held)), index, -1)
    index[:, 0] = held[seed % len(held)]
    return torch.randn(tokens, store.hidden_size, generator=generator), index, torch.rand(tokens, 3, generator=generator)


@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_float_experts_answer_known_metadata_on_the_lane_with_the_full_paths_frame(qwen2_moe, mode):
    """Per held set (every expert; experts 2-5), token count and timing: the first DISPATCH of each
    metadata goes the full path, the next ones the lane; each RESULT is the one the full path encodes
    for the store's answer (metadata fields, and bytes but for the CPU time; the payload's bytes)."""
    for held in (list(range(EXPERTS)), [2, 3, 4, 5]):
        store = store_of(qwen2_moe, held)
        computation = Computation(store, WorkerLimits())
        for tokens, timed in ((1, False), (3, True)):
            before = computation.express.answered
            for seed in range(4):
                hidden, index, weights = routing(store, tokens, held, seed)
                request = Dispatch(1, hidden, index, weights, mode, timed=timed)
                reply = computation.one(received(request))
                assert reply.opcode == Opcode.RESULT, ErrorReply.from_frame(reply).message
                full = store.run(request).to_frame(7, 0.0 if timed else None)
                assert b"".join(bytes(part) for part in reply.parts) == b"".join(bytes(part) for part in full.parts)
                assert list(reply.meta) == list(full.meta)
                assert {key: value for key, value in reply.meta.items() if key != "cpu_us"} == \
                    {key: value for key, value in full.meta.items() if key != "cpu_us"}
            assert computation.express.answered == before + 3  # all but the first of each metadata


def test_values_the_store_refuses_go_the_full_path_and_are_named(qwen2_moe):
    """After the lane is known, an expert held elsewhere and an id out of range are answered ERROR
    with the full path's words; a payload of another length goes the full path; the lane goes on."""
    held = [2, 3, 4, 5]
    store = store_of(qwen2_moe, held)
    computation = Computation(store, WorkerLimits())
    hidden, index, weights = routing(store, 1, held, 0)
    computation.one(received(Dispatch(1, hidden, index, weights, CombineMode.PARTIAL)))
    for bad, message in ((1, "expert 1 of layer 1 is not held by this worker"), (200, "expert id 200 out of range")):
        ids = index.clone()
        ids[0, 0] = bad
        reply = computation.one(received(Dispatch(1, hidden, ids, weights, CombineMode.PARTIAL)))
        assert reply.opcode == Opcode.ERROR and message in ErrorReply.from_frame(reply).message
    answered = computation.express.answered
    reply = computation.one(received(Dispatch(1, hidden, index, weights, CombineMode.PARTIAL)))
    assert torch.equal(Result.from_frame(decode_frame(*_parsed(reply))).outputs,
                       store.run(Dispatch(1, hidden, index, weights, CombineMode.PARTIAL)).outputs)
    assert computation.express.answered == answered + 1


@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_a_decode_step_s_dispatch_to_float_experts_is_answered_whole_on_the_event_loop(qwen2_moe, mode):
    """Over real TCP: after the first DISPATCH of each metadata, each next one-token DISPATCH is
    answered in the transport's callback or by the connection's hold, its RESULT the full path's
    frame, bit for bit (timed: but for its CPU time, whose field is where the full path puts it)."""
    from test_worker_limits import greeted, recv
    from test_worker_runner import running

    from moeswarm.wire.stream import send_frame
    from moeswarm.worker.server import WorkerServer

    held = list(range(EXPERTS))
    store = store_of(qwen2_moe, held)
    server = WorkerServer(store, "hf-limits01", "scale", WorkerLimits(), inline_tokens=8)
    with running(server) as (_, address):
        sock = greeted(address)
        for timed in (False, True):
            for seed in range(5):
                hidden, index, weights = routing(store, 1, held, seed)
                request = Dispatch(0, hidden, index, weights, mode, timed=timed)
                send_frame(sock, request.to_frame(30 + seed))
                reply = recv(sock)
                assert (reply.opcode, reply.request_id) == (Opcode.RESULT, 30 + seed), \
                    ErrorReply.from_frame(reply).message
                full = store.run(request).to_frame(30 + seed, 0.0 if timed else None)
                assert reply.payload == b"".join(bytes(p) for p in full.parts)
                if timed:
                    assert list(reply.meta) == list(full.meta) and 0 <= reply.meta["cpu_us"] < 10**7
                    full.meta["cpu_us"] = reply.meta["cpu_us"]
                assert reply.meta_bytes == pack_meta(full.meta)
        sock.close()
    assert server.computation.express.whole == 8  # all but the first of each metadata
    assert server.computation.express.hold.answered >= 1  # of them, the third to fifth of each while held (worker/hold.py)


@pytest.mark.parametrize("family, sums_itself", [("qwen2_moe", True), ("mixtral", True), ("gpt_oss", False)])
def test_eager_experts_that_skip_their_sentinel_give_the_pairs_bits(tiny_models, family, sums_itself):
    """transformers' eager experts one-hot ids into num_experts + 1 classes and skip the last (gpt-oss's
    into num_experts: probed unfit). Where the probe finds the module fit, a PARTIAL DISPATCH is one
    call of it with the sentinel in other holders' slots, whose sums equal, bit for bit, the pairs'
    rows added in eager's order, over many tokens and held sets."""
    model = tiny_models(family)
    for held in (list(range(EXPERTS)), [3, 4, 5, 6]):
        store = store_of(model, held)
        module = store._runs[0][0].module
        assert (_sentinel(module, store.hidden_size) is not None) == sums_itself
        assert (store._runs[0][0].sentinel is not None) == sums_itself
        for seed in range(6):
            hidden, index, weights = routing(store, 1 + 5 * seed, held, seed)
            request = Dispatch(0, hidden, index, weights, CombineMode.PARTIAL)
            with torch.inference_mode():
                rows, _, _, token_ids = _pairs(store._runs[0], hidden, index.numpy().astype(np.int64), weights)
                assert torch.equal(store.run(request).outputs, _by_token(rows, token_ids, hidden.shape[0]))


@pytest.mark.parametrize("family, one_call", [("qwen2_moe", True), ("mixtral", True), ("gpt_oss", False)])
def test_a_one_call_answer_is_the_full_paths_frame_and_refuses_what_it_refuses(tiny_models, family, one_call):
    """Where the store's experts sum a partial DISPATCH themselves, a known one's whole answer is one
    module call on the payload (`TorchLane._sums_now`, its input tensors reused): per held set (every
    expert; experts 3-6, other holders' slots in the ids), token count and timing, its frame is the
    full path's for the store's answer (timed: but for the CPU time's value), call after call. Ids
    the store refuses (an expert held elsewhere, one out of range) are declined (the full path names
    them); gpt-oss's experts (probed unfit) have no one-call answer."""
    model = tiny_models(family)
    for held in (list(range(EXPERTS)), [3, 4, 5, 6]):
        store = store_of(model, held)
        computation = Computation(store, WorkerLimits())
        for tokens, timed in ((1, False), (1, True), (3, True)):
            for seed in range(4):
                hidden, index, weights = routing(store, tokens, held, seed)
                request = Dispatch(1, hidden, index, weights, CombineMode.PARTIAL, timed=timed)
                header, body = _parsed(received(request, 40 + seed))
                if seed == 0:
                    computation.one(decode_frame(header, body))  # the full path: the lane is learned
                lane = computation.express.whole_lane(body, header.meta_len)
                assert (lane.sums is not None) == one_call
                if not one_call:
                    continue
                before = store.served.rows[1].copy()  # [E]: rows counted so far (worker/served.py)
                reply = lane._sums_now(body, 40 + seed)
                routed = np.bincount(index[index >= 0].numpy(), minlength=EXPERTS)  # [E]
                assert np.array_equal(store.served.rows[1] - before, routed)  # each routed row counted once
                full = store.run(request).to_frame(40 + seed, 0.0 if timed else None)
                got = decode_frame(parse_header(bytes(reply[:HEADER_SIZE])), bytes(reply[HEADER_SIZE:]))
                assert got.payload == b"".join(bytes(part) for part in full.parts)
                if timed:
                    assert list(got.meta) == list(full.meta) and 0 <= got.meta["cpu_us"] < 10**7
                    full.meta["cpu_us"] = got.meta["cpu_us"]
                assert got.meta_bytes == pack_meta(full.meta) and got.request_id == 40 + seed
            if one_call:
                for bad in (1, 200) if held[0] else (200,):
                    ids = index.clone()
                    ids[0, 0] = bad
                    header, body = _parsed(received(Dispatch(1, hidden, ids, weights, CombineMode.PARTIAL, timed=timed)))
                    lane = computation.express.whole_lane(body, header.meta_len)
                    before = store.served.rows[1].copy()
                    assert lane is not None and lane._sums_now(body, 1) is None
                    assert np.array_equal(store.served.rows[1], before)  # declined: the full path counts it

