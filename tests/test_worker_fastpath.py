"""RESULTs sent from the compute thread (worker/session.py `write_now`) keep every guarantee of the loop's path.

An in-process WorkerServer on real TCP (test_worker_limits' ScaleStore: every RESULT is checked
against a computation here). A RESULT larger than the socket's buffers leaves partly from the
compute thread and partly from the loop, with PINGs answered meanwhile: every frame still
arrives whole, RESULTs in the order of their DISPATCHes. A connection that closes while its
DISPATCH computes never sends that RESULT to the connection that comes after it. A DISPATCH of a
few tokens that finds the compute thread idle runs on the event loop itself (`inline_tokens`,
worker/runner.py `run_here`); a larger one, or one arriving while another computes, on the thread.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import Result
from moeswarm.wire.stream import send_frame
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.runner import ComputeRunner
from moeswarm.worker.server import WorkerServer
from test_worker_limits import (FINGERPRINT, ScaleStore, expect_result, expected_result, greeted, recv, request,
                                serving, wait_until)
from test_worker_runner import running


class ThreadStore(ScaleStore):
    """ScaleStore, noting the name of the thread each `run` ran on."""

    def __init__(self, **options):
        super().__init__(**options)
        self.threads: list[str] = []

    def run(self, request):
        self.threads.append(threading.current_thread().name)
        return super().run(request)


def test_small_dispatches_run_on_the_event_loop_when_the_compute_thread_is_idle():
    """One at a time: 1 and 8 tokens run on the loop's thread, 9 and 4096 on the compute thread;
    every RESULT is the store's answer. Then pipelined, a large one first: the small ones behind it
    find the thread busy or others waiting, and every RESULT still comes back in order."""
    store = ThreadStore()
    server = WorkerServer(store, FINGERPRINT, "scale", WorkerLimits(max_unsent_bytes=64 << 20), inline_tokens=8)
    with running(server) as (loop, address):
        loop_thread = asyncio.run_coroutine_threadsafe(_thread_name(), loop).result(10)
        sock = greeted(address)
        sizes = [1, 8, 9, 4096, 1]
        for i, tokens in enumerate(sizes):
            dispatch = request(tokens=tokens, ids=[[0, 1, 2, 3]] * tokens, seed=i)
            send_frame(sock, dispatch.to_frame(30 + i))
            expect_result(sock, dispatch, 30 + i)
        assert store.threads == [loop_thread, loop_thread, "moeswarm-compute", "moeswarm-compute", loop_thread]
        sent = [request(tokens=t, ids=[[0, 1, 2, 3]] * t, seed=10 + i) for i, t in enumerate([4096, 1, 1, 2048, 1])]
        for i, dispatch in enumerate(sent):
            send_frame(sock, dispatch.to_frame(40 + i))
        for i, dispatch in enumerate(sent):
            expect_result(sock, dispatch, 40 + i)
        send_frame(sock, Frame(Opcode.PING, 99))
        pong = recv(sock)
        assert (pong.opcode, pong.request_id) == (Opcode.PONG, 99)


async def _thread_name() -> str:
    return threading.current_thread().name


def test_a_runner_runs_a_job_in_place_only_when_nothing_runs_or_waits():
    """`run_here` refuses while the compute thread serves a job, runs the job on the caller's
    thread once it is idle, and the thread then serves what is queued."""
    async def scenario():
        runner = ComputeRunner()
        runner.start()
        gate, outcomes = threading.Event(), []

        def record(value, error):
            outcomes.append((value, error, threading.current_thread().name))

        runner.submit("a", lambda: gate.wait(10) and "slow", done=record)
        await asyncio.to_thread(wait_until, lambda: runner.queued == 0)  # taken by the thread
        assert not runner.run_here("b", lambda: "small", 1, record)
        gate.set()
        await asyncio.to_thread(wait_until, lambda: len(outcomes) == 1)
        while not runner.run_here("b", lambda: "small", 1, record):  # the thread is between jobs
            await asyncio.sleep(0.005)
        runner.submit("a", lambda: "queued", done=record)
        await asyncio.to_thread(wait_until, lambda: len(outcomes) == 3)
        await runner.close()
        return outcomes

    outcomes = asyncio.run(scenario())
    here = threading.current_thread().name
    assert outcomes == [("slow", None, "moeswarm-compute"), ("small", None, here), ("queued", None, "moeswarm-compute")]


def test_a_runner_that_runs_out_of_work_says_so_each_time():
    """`on_idle` (the worker's kernels rest then) is called when the compute thread finds nothing
    to run and after a job run in place leaves nothing queued, never while a job waits its turn."""
    async def scenario():
        idle = []
        runner = ComputeRunner(on_idle=lambda: idle.append(runner.queued))
        runner.start()
        await asyncio.to_thread(wait_until, lambda: len(idle) == 1)  # the thread started with nothing to do
        gate, outcomes = threading.Event(), []
        runner.submit("a", lambda: gate.wait(10) and "slow", done=lambda value, error: outcomes.append(value))
        runner.submit("b", lambda: "queued", done=lambda value, error: outcomes.append(value))
        await asyncio.to_thread(wait_until, lambda: runner.queued == 1)  # "slow" runs, "queued" waits
        before = len(idle)
        gate.set()
        await asyncio.to_thread(wait_until, lambda: len(outcomes) == 2 and len(idle) > before)
        assert idle[before:] == [0] * (len(idle) - before)  # idle only once both had run
        ran, value = runner.run_now("c", lambda: "here", 1)
        assert (ran, value) == (True, "here") and idle[-1] == 0
        await runner.close()
        return before

    assert asyncio.run(scenario()) == 1  # nothing more while "slow" ran and "queued" waited


def test_results_larger_than_the_socket_buffers_arrive_whole_and_in_order_between_pongs():
    """Each RESULT is 4 MB (4096 tokens x 4 experts x 64 values), the client's receive buffer 32 KB:
    no RESULT fits the kernel at once, so each one's rest is written by the loop, while PINGs on the
    same connection are answered."""
    sent = [request(tokens=4096, ids=[[0, 1, 2, 3]] * 4096, seed=i) for i in range(3)]
    with serving(max_unsent_bytes=64 << 20) as (_, address):
        sock = greeted(address, rcvbuf=32 << 10)
        for i, dispatch in enumerate(sent):
            send_frame(sock, dispatch.to_frame(10 + i))
            send_frame(sock, Frame(Opcode.PING, 100 + i))
        results, pongs = [], []
        while len(results) < len(sent) or len(pongs) < len(sent):
            frame = recv(sock)
            (pongs if frame.opcode == Opcode.PONG else results).append(frame)
        assert sorted(p.request_id for p in pongs) == [100, 101, 102]
        assert [r.request_id for r in results] == [10, 11, 12]  # the order of the DISPATCHes
        for frame, dispatch in zip(results, sent):
            assert frame.opcode == Opcode.RESULT
            assert torch.equal(Result.from_frame(frame).outputs, expected_result(dispatch).outputs)


def test_pipelined_small_and_large_results_keep_their_order():
    """Small RESULTs that could leave from the compute thread at once wait behind a large one the
    loop is still writing: one connection's RESULTs leave in the order of its DISPATCHes."""
    sizes = [1, 4096, 1, 1, 2048, 1, 1, 1]
    sent = [request(tokens=t, ids=[[0, 1, 2, 3]] * t, seed=i) for i, t in enumerate(sizes)]
    with serving(max_unsent_bytes=64 << 20, queue_per_connection=16) as (_, address):
        sock = greeted(address, rcvbuf=32 << 10)
        for i, dispatch in enumerate(sent):
            send_frame(sock, dispatch.to_frame(20 + i))
        for i, dispatch in enumerate(sent):
            expect_result(sock, dispatch, 20 + i)
        send_frame(sock, Frame(Opcode.PING, 99))  # the stream is still in step
        pong = recv(sock)
        assert (pong.opcode, pong.request_id) == (Opcode.PONG, 99)


def test_a_result_whose_connection_closed_never_reaches_the_next_connection():
    """The compute thread writes on its own duplicate of the socket: when the connection closes while
    its DISPATCH computes, the next connection (which may get the same descriptor number) receives
    only its own replies."""
    store = ScaleStore(gated=True)
    with serving(store) as (server, address):
        first = greeted(address)
        send_frame(first, request(tokens=8, seed=1).to_frame(7))
        wait_until(lambda: store.calls == 1)  # computing, held by the gate
        first.close()
        wait_until(lambda: server.connections == 0)
        second = greeted(address)  # accepted after the first's descriptor was closed
        store.permits.release()  # the first's RESULT is made now: it has nowhere to go
        wait_until(lambda: server.budget.held == 0)
        later = request(tokens=1, seed=2)
        send_frame(second, later.to_frame(8))
        store.permits.release()
        expect_result(second, later, 8)  # its first reply is its own RESULT, not request 7's
        send_frame(second, Frame(Opcode.PING, 9))
        pong = recv(second)
        assert (pong.opcode, pong.request_id) == (Opcode.PONG, 9)


def test_results_for_several_connections_at_once_each_reach_their_own():
    """Four clients pipelining at once, each checking every RESULT it gets against its own requests."""
    failures: list[BaseException] = []
    with serving(max_unsent_bytes=64 << 20) as (_, address):
        def client(number: int) -> None:
            try:
                sock = greeted(address, rcvbuf=64 << 10)
                sent = [request(tokens=1 + 300 * (i % 3), ids=[[number % 4, 3 - number % 4]] * (1 + 300 * (i % 3)),
                                seed=100 * number + i) for i in range(12)]
                for i, dispatch in enumerate(sent):
                    send_frame(sock, dispatch.to_frame(1000 * number + i))
                for i, dispatch in enumerate(sent):
                    expect_result(sock, dispatch, 1000 * number + i)
                sock.close()
            except BaseException as error:  # reported by the test thread
                failures.append(error)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(1, 5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert not failures, failures


def test_unpack_decodes_every_raw_codec_exactly_as_the_codec_does():
    """wire/tensors.py decodes raw codecs itself (the worker's decode path): the same tensors, bit for
    bit, as each codec's own decode, for every wire dtype into every dtype."""
    from moeswarm.wire import tensors as wire_tensors
    from moeswarm.wire.codecs import CODECS, DTYPES

    generator = torch.Generator().manual_seed(3)
    values = torch.randn(3, 5, generator=generator) * 300
    values[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    for codec_name, codec in CODECS.items():
        if codec_name not in DTYPES:
            continue  # blockwise codecs decode themselves
        for dtype_name, dtype in DTYPES.items():
            source = values.to(dtype) if dtype.is_floating_point else values.nan_to_num(0, 0, 0).clamp(0, 200).to(dtype)
            encoded = bytes(codec.encode(source))
            got = wire_tensors.unpack([["t", codec_name, dtype_name, [3, 5]]], encoded)["t"]
            want = codec.decode(memoryview(encoded), (3, 5), dtype)
            assert got.dtype == want.dtype and got.shape == want.shape, (codec_name, dtype_name)
            assert torch.equal(got.view(torch.uint8) if got.is_floating_point() else got,
                               want.view(torch.uint8) if want.is_floating_point() else want), (codec_name, dtype_name)


def test_a_failure_outside_the_experts_is_answered_internal_and_the_worker_goes_on():
    """Computation answers every request itself; should the work fail anyway (a bug), the client gets an
    ERROR "internal" for that request instead of waiting for its deadline, and the connection stays usable."""
    from moeswarm.wire.messages import ErrorReply

    with serving() as (server, address):
        calls = []

        def broken(frame, sized=False):
            calls.append(frame.request_id)
            raise RuntimeError("boom")

        server.computation.one = broken
        sock = greeted(address)
        send_frame(sock, request(tokens=1).to_frame(5))
        reply = recv(sock)
        assert (reply.opcode, reply.request_id) == (Opcode.ERROR, 5)
        assert ErrorReply.from_frame(reply) == ErrorReply("internal", "RuntimeError: boom")
        assert calls == [5]
        del server.computation.one  # the class's own again
        sent = request(tokens=2, seed=4)
        send_frame(sock, sent.to_frame(6))
        expect_result(sock, sent, 6)
