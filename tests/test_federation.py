"""Federation: one worker serves several backbones at once.

- merging (worker/merge.py): DISPATCHes of one layer from several connections, with disjoint
  expert sets, run as one expert call whose split answers are bit-identical to unmerged calls;
- the worker merges what waits in its queue, and only what keeps the bits;
- two backbones (separate `moeswarm generate` processes) against the same worker processes at
  once, each bit-identical to its local eager run;
- fair share: a connection flooding the worker does not hold another's requests behind its backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import torch

from moeswarm.bundled import TRAINED
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import Opcode
from moeswarm.wire.messages import Dispatch, Hello, Result
from moeswarm.wire.stream import recv_frame, send_frame
from moeswarm.worker.merge import merge, partners, split
from moeswarm.worker.server import WorkerServer

WAIT_S = 30.0
HELD = list(range(16))  # the experts of layer 0 the in-process store holds
BLOCKER = 12345.0  # hidden[0, 0] of the request the gated store holds back

pytestmark = pytest.mark.skipif(not (TRAINED / "model.safetensors").exists(), reason="bundled model not present")


@pytest.fixture(scope="module")
def store():
    from moeswarm.sources.loading import load_experts
    from moeswarm.worker.store import ExpertStore

    hosted, source, num_experts = load_experts(TRAINED, HELD, layers=(0, 0))
    return ExpertStore(hosted, num_experts, source.config.hidden_size), source


def _request(generator: torch.Generator, tokens: int, experts: list[int], mode: CombineMode = CombineMode.EXACT,
             k: int = 8) -> Dispatch:
    """`tokens` tokens routed to up to k of `experts` each (-1 for the other slots)."""
    chosen = torch.tensor(experts)[torch.rand(tokens, len(experts), generator=generator).argsort(dim=1)[:, :k]]
    index = torch.full((tokens, k), -1)
    width = min(k, len(experts))
    index[:, :width] = chosen[:, :width]  # [T, k]
    return Dispatch(0, torch.randn(tokens, 128, generator=generator), index, torch.rand(tokens, k, generator=generator),
                    mode)


@pytest.mark.parametrize("mode", [CombineMode.EXACT, CombineMode.PARTIAL])
def test_merged_call_splits_into_bit_identical_answers(store, mode):
    expert_store, _ = store
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        shuffled = torch.randperm(16, generator=generator).tolist()
        sets = [sorted(shuffled[:5]), sorted(shuffled[5:9]), sorted(shuffled[9:16])]  # disjoint
        requests = [_request(generator, int(torch.randint(1, 7, (1,), generator=generator)), s, mode) for s in sets]
        assert partners(requests) == [0, 1, 2]
        merged, plan = merge(requests)
        for request, answer in zip(requests, split(expert_store.run(merged), plan)):
            alone = expert_store.run(request)
            assert torch.equal(answer.outputs, alone.outputs)
            assert (answer.experts, answer.counts, answer.mode) == (alone.experts, alone.counts, alone.mode)


def test_requests_sharing_an_expert_are_not_merged(store):
    generator = torch.Generator().manual_seed(2)
    first = _request(generator, 3, [0, 1, 2])
    sharing = _request(generator, 3, [2, 3])  # expert 2 in both: its matmul would see other rows
    disjoint = _request(generator, 2, [5, 6])
    partial = _request(generator, 2, [7, 8], CombineMode.PARTIAL)
    assert partners([first, sharing, disjoint, partial]) == [0, 2]
    with pytest.raises(ValueError, match="share experts"):
        merge([first, sharing])


# -- the worker merges what waits ---------------------------------------------------------------------


class GatedStore:
    """The real store, holding back the one request whose hidden[0, 0] is BLOCKER until released,
    so that what the test sends next waits in the runner's queue."""

    def __init__(self, store):
        self.store = store
        self.num_experts, self.hidden_size, self.held = store.num_experts, store.hidden_size, store.held
        self.entered, self.permits = threading.Semaphore(0), threading.Semaphore(0)
        self.calls = 0
        self.tags: list[float] = []  # hidden[0, 0] of each request run, in order

    def describe(self) -> str:
        return self.store.describe()

    def run(self, request: Dispatch) -> Result:
        self.calls += 1
        self.tags.append(float(request.hidden[0, 0]))
        if request.hidden[0, 0] == BLOCKER:
            self.entered.release()
            assert self.permits.acquire(timeout=WAIT_S), "the test never released the store"
        return self.store.run(request)


@contextlib.contextmanager
def _serving(server: WorkerServer):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(WAIT_S)
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


def _greeted(address, fingerprint: str) -> socket.socket:
    sock = socket.create_connection(address, timeout=WAIT_S)
    send_frame(sock, Hello(fingerprint).to_frame(1))
    assert recv_frame(sock, time.monotonic() + WAIT_S)[0].opcode == Opcode.HELLO
    return sock


def _result(sock: socket.socket, request_id: int) -> Result:
    frame = recv_frame(sock, time.monotonic() + WAIT_S)[0]
    assert (frame.opcode, frame.request_id) == (Opcode.RESULT, request_id), frame
    return Result.from_frame(frame)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_worker_merges_queued_dispatches_of_several_backbones_and_keeps_the_bits(store):
    expert_store, source = store
    gated = GatedStore(expert_store)
    server = WorkerServer(gated, source.fingerprint, source.config.model_type)
    generator = torch.Generator().manual_seed(3)
    blocker = _request(generator, 1, [15])
    blocker.hidden[0, 0] = BLOCKER
    rounds = [  # (requests of backbones A and B, whether they merge)
        ((_request(generator, 1, list(range(0, 7))), _request(generator, 1, list(range(7, 15)))), True),
        ((_request(generator, 4, [0, 1, 2], CombineMode.PARTIAL), _request(generator, 2, [3, 4], CombineMode.PARTIAL)), True),
        ((_request(generator, 2, [0, 1, 2]), _request(generator, 2, [2, 3])), False),  # expert 2 in both
        ((_request(generator, 2, [0, 1]), _request(generator, 2, [2, 3], CombineMode.PARTIAL)), False),  # two modes
    ]
    with _serving(server) as address:
        holder, a, b = (_greeted(address, source.fingerprint) for _ in range(3))
        merged = 0
        for number, ((first, second), merges) in enumerate(rounds):
            send_frame(holder, blocker.to_frame(100 + number))
            assert gated.entered.acquire(timeout=WAIT_S)  # the compute thread is busy with the blocker
            send_frame(a, first.to_frame(200 + number))
            _wait_until(lambda: server.runner.queued == 1, "A's DISPATCH queued")
            send_frame(b, second.to_frame(300 + number))
            _wait_until(lambda: server.runner.queued == 2, "B's DISPATCH queued")
            calls = gated.calls
            gated.permits.release()
            _result(holder, 100 + number)
            for sock, rid, request in ((a, 200 + number, first), (b, 300 + number, second)):
                got, alone = _result(sock, rid), expert_store.run(request)
                assert torch.equal(got.outputs, alone.outputs)
                assert got.mode == request.mode
                if request.mode == CombineMode.EXACT:
                    assert (got.experts, got.counts) == (alone.experts, alone.counts)
            merged += merges
            assert (server.merged_calls, server.merged_requests) == (merged, 2 * merged)
            assert gated.calls - calls == (1 if merges else 2)  # expert calls after the blocker's
        for sock in (holder, a, b):
            sock.close()


# -- two backbones, fair share ---------------------------------------------------------------------------


def test_two_backbones_at_once_each_bit_identical_to_local(qwen2_moe, qwen2_workers):
    """Two backbones (two swarms, each on its own thread) generate against the same two worker
    processes at the same time; each is compared with its own local eager model step by step."""
    from moeswarm.engine.generate import generate
    from moeswarm.sources.loading import load_local
    from moeswarm.swarm import open_swarm

    prompts = [[72, 101, 108, 108, 111, 44, 32], [100, 101, 102, 32, 102, 40, 120, 41, 58]]
    results, failures = {}, []

    def backbone(number: int, swarm, reference) -> None:
        try:
            results[number] = generate(swarm, prompts[number], 12, 0, reference)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    with contextlib.ExitStack() as stack:  # loading is not thread-safe: load first, then run at once
        swarms = [stack.enter_context(open_swarm(qwen2_moe, qwen2_workers)) for _ in prompts]
        threads = [threading.Thread(target=backbone, args=(n, swarms[n], load_local(qwen2_moe))) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    assert not failures, failures
    for number in range(2):
        assert results[number].bit_identical is True and len(results[number].tokens) == 12


def test_a_flooding_connection_does_not_hold_back_another(store):
    """One connection queues 16 large DISPATCHes (2048 tokens each), another 5 small ones while the
    flood's first is computing: the 5 small ones run next, before the rest of the flood (shared by
    tokens; FIFO would run the whole flood first). Real store and TCP; the order is the store's."""
    expert_store, source = store
    gated = GatedStore(expert_store)
    server = WorkerServer(gated, source.fingerprint, source.config.model_type)
    generator = torch.Generator().manual_seed(4)
    # partial mode: 16 replies of [2048, d] stay within what a connection may owe (exact ones would not)
    flood = [_request(generator, 2048, HELD, CombineMode.PARTIAL) for _ in range(16)]
    flood[0].hidden[0, 0] = BLOCKER
    small = [_request(generator, 1, [0, 5, 9]) for _ in range(5)]
    with _serving(server) as address:
        flooder, normal = _greeted(address, source.fingerprint), _greeted(address, source.fingerprint)
        for number, request in enumerate(flood):
            send_frame(flooder, request.to_frame(1000 + number))
        reader = threading.Thread(target=lambda: [_result(flooder, 1000 + n) for n in range(16)], daemon=True)
        reader.start()  # the flood's RESULTs are taken as they come
        assert gated.entered.acquire(timeout=WAIT_S)
        _wait_until(lambda: server.runner.queued == 15, "the flood queued")
        for number, request in enumerate(small):
            send_frame(normal, request.to_frame(10 + number))
        _wait_until(lambda: server.runner.queued == 20, "the small DISPATCHes queued")
        gated.permits.release()
        for number, request in enumerate(small):
            assert torch.equal(_result(normal, 10 + number).outputs, expert_store.run(request).outputs)
        reader.join(WAIT_S)
        assert not reader.is_alive()
        flooder.close()
        normal.close()
    tags = [float(r.hidden[0, 0]) for r in flood[:1] + small + flood[1:]]
    assert gated.tags == tags  # the flood's first, the 5 small ones, then the rest of the flood
