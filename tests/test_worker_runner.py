"""The worker computes off its event loop: PINGs answered during compute, fair and bounded queues.

An in-process WorkerServer on a background thread's event loop, real TCP on 127.0.0.1, and a fake
store whose `run` blocks until the test hands it a permit: every ordering below is proved by what
cannot have happened yet (no permit, no RESULT), not by timing thresholds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from moeswarm.errors import MoeSwarmError, ProtocolError
from moeswarm.wire.codecs import CODECS
from moeswarm.wire.frames import HEADER, MAGIC, VERSION, Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result, WorkerInfo
from moeswarm.wire.stream import StreamClosed, recv_frame, send_frame
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.server import WorkerServer

FINGERPRINT = "hf-test0001"
HIDDEN = 8
WAIT_S = 10.0
BAD_LAYER, BUGGY_LAYER = 1, 2


class FakeStore:
    """Four experts of layer 0; `run` echoes 2 * x and, when gated, waits for a permit first.

    calls: the tag (x[0, 0]) of every request `run` started, in order; finished: of those it ended.
    """

    num_experts = 4
    hidden_size = HIDDEN
    held = {0: (0, 1, 2, 3)}

    def __init__(self, gated: bool = True):
        self.gated = gated
        self.permits = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)  # one release per started run
        self.calls: list[int] = []
        self.finished: list[int] = []

    def describe(self) -> str:
        return "layer 0, experts 0-3"

    def release(self, runs: int = 1) -> None:
        for _ in range(runs):
            self.permits.release()

    def run(self, request: Dispatch) -> Result:
        tag = int(request.hidden[0, 0])
        self.calls.append(tag)
        self.entered.release()
        if self.gated and not self.permits.acquire(timeout=30):
            raise RuntimeError("test never released the fake store")
        self.finished.append(tag)
        if request.layer == BAD_LAYER:
            raise ProtocolError(f"layer {BAD_LAYER} is not served by this worker (it serves {self.describe()})")
        if request.layer == BUGGY_LAYER:
            raise RuntimeError("boom")
        rows = request.hidden.shape[0]
        return Result(request.layer, request.mode, request.hidden * 2, [0], [rows], request.wire_combine)


@contextlib.contextmanager
def running(server: WorkerServer):
    """(loop, (host, port)): `server` started on its own event loop in a daemon thread; closed after."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop, asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(WAIT_S)
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


@contextlib.contextmanager
def serving(store: FakeStore, **options):
    """(server, (host, port)) serving the fake store; nothing stays blocked in it afterwards."""
    server = WorkerServer(store, FINGERPRINT, "fake", WorkerLimits(**options))
    with running(server) as (_, address):
        try:
            yield server, address
        finally:
            store.release(1000)  # before close(), which waits for the running job


def _connect(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _greeted(address) -> socket.socket:
    sock = _connect(address)
    send_frame(sock, Hello(FINGERPRINT).to_frame(1))
    assert _recv(sock).opcode == Opcode.HELLO
    return sock


def _recv(sock: socket.socket) -> Frame:
    return recv_frame(sock, time.monotonic() + WAIT_S)[0]


def _hidden(tag: int) -> torch.Tensor:
    return torch.full((2, HIDDEN), float(tag))  # [T, d], tagged by its value


def _dispatch(tag: int, request_id: int, layer: int = 0) -> Frame:
    return Dispatch(layer, _hidden(tag), torch.tensor([[0, 1], [3, -1]]), torch.rand(2, 2)).to_frame(request_id)


def _expect_result(sock: socket.socket, tag: int, request_id: int) -> None:
    reply = _recv(sock)
    assert (reply.opcode, reply.request_id) == (Opcode.RESULT, request_id), reply
    result = Result.from_frame(reply)
    assert torch.equal(result.outputs, _hidden(tag) * 2)
    assert (result.experts, result.counts) == ([0], [2])


def _expect_error(sock: socket.socket, request_id: int, code: str, message: str) -> None:
    reply = _recv(sock)
    assert (reply.opcode, reply.request_id) == (Opcode.ERROR, request_id), reply
    assert ErrorReply.from_frame(reply) == ErrorReply(code, message)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _computing(store: FakeStore) -> None:
    assert store.entered.acquire(timeout=WAIT_S), "the fake store's run never started"


# -- the HELLO handshake ------------------------------------------------------------------------


def test_hello_answers_what_the_worker_holds():
    with serving(FakeStore(gated=False), max_unsent_bytes=5 << 20) as (_, address):
        sock = _connect(address)
        send_frame(sock, Hello(FINGERPRINT).to_frame(7))
        reply = _recv(sock)
        assert (reply.opcode, reply.request_id) == (Opcode.HELLO, 7)
        assert WorkerInfo.from_frame(reply) == WorkerInfo(FINGERPRINT, "fake", 4, HIDDEN, {0: (0, 1, 2, 3)},
                                                          tuple(sorted(CODECS)), 5 << 20)  # its reply bound


def test_dispatch_before_hello_and_wrong_fingerprint_are_refused():
    with serving(FakeStore(gated=False)) as (_, address):
        sock = _connect(address)
        send_frame(sock, _dispatch(1, 2))
        _expect_error(sock, 2, "bad_request", "DISPATCH before HELLO: send HELLO with the model fingerprint first")
        send_frame(sock, Hello("hf-0000").to_frame(3))
        _expect_error(sock, 3, "bad_request",
                      f"model fingerprint mismatch: this worker serves fake model {FINGERPRINT}, the backbone runs hf-0000")
        send_frame(sock, _dispatch(1, 4))  # a refused HELLO does not greet
        _expect_error(sock, 4, "bad_request", "DISPATCH before HELLO: send HELLO with the model fingerprint first")
        send_frame(sock, Hello(FINGERPRINT).to_frame(5))  # the connection stayed usable
        assert _recv(sock).opcode == Opcode.HELLO
        send_frame(sock, _dispatch(1, 6))
        _expect_result(sock, 1, 6)


# -- PING during compute ------------------------------------------------------------------------


def test_ping_on_another_connection_is_answered_while_experts_compute():
    store = FakeStore()
    with serving(store) as (_, address):
        busy, idle = _greeted(address), _greeted(address)
        send_frame(busy, _dispatch(7, 2))
        _computing(store)  # and it stays in run() until released
        send_frame(idle, Frame(Opcode.PING, 3))
        pong = _recv(idle)
        assert (pong.opcode, pong.request_id) == (Opcode.PONG, 3)
        store.release()  # only now can the RESULT exist
        _expect_result(busy, 7, 2)


def test_ping_on_the_same_connection_overtakes_the_running_dispatch():
    store = FakeStore()
    with serving(store) as (_, address):
        sock = _greeted(address)
        send_frame(sock, _dispatch(7, 2))
        _computing(store)
        send_frame(sock, Frame(Opcode.PING, 3))
        pong = _recv(sock)
        assert (pong.opcode, pong.request_id) == (Opcode.PONG, 3)
        store.release()
        _expect_result(sock, 7, 2)


# -- the bounded queue ---------------------------------------------------------------------------


def test_full_queue_answers_busy_then_serves_what_it_queued():
    store = FakeStore()
    with serving(store, queue_limit=2) as (server, address):
        first, other = _greeted(address), _greeted(address)
        send_frame(first, _dispatch(1, 11))
        _computing(store)  # running: not counted as queued
        send_frame(first, _dispatch(2, 12))
        send_frame(first, _dispatch(3, 13))
        _wait_until(lambda: server.runner.queued == 2, "two queued DISPATCHes")
        busy = "worker busy: 2 requests queued (limit 2); retry later"
        send_frame(first, _dispatch(4, 14))
        _expect_error(first, 14, "busy", busy)
        send_frame(other, _dispatch(5, 15))  # a connection with nothing waiting is still admitted...
        _wait_until(lambda: server.runner.queued == 3, "the other connection's DISPATCH queued")
        send_frame(other, _dispatch(6, 16))  # ...but not a second one: the limit is over all connections
        _expect_error(other, 16, "busy", "worker busy: 3 requests queued (limit 2); retry later")
        store.release(4)
        for tag, request_id in ((1, 11), (2, 12), (3, 13)):
            _expect_result(first, tag, request_id)
        _expect_result(other, 5, 15)
        send_frame(other, _dispatch(7, 17))  # room again
        store.release()
        _expect_result(other, 7, 17)
        assert store.calls == [1, 5, 2, 3, 7]


def test_queue_limit_must_be_positive():
    with pytest.raises(MoeSwarmError, match=r"^worker limit queue-limit must be positive, got 0$"):
        WorkerLimits(queue_limit=0)


# -- fairness --------------------------------------------------------------------------------------


def test_connections_are_served_in_turn_not_backlog_first():
    store = FakeStore()
    with serving(store) as (server, address):
        a, b = _greeted(address), _greeted(address)
        for tag in range(1, 6):
            send_frame(a, _dispatch(tag, tag))
        _computing(store)  # A's first runs; four wait
        _wait_until(lambda: server.runner.queued == 4, "A's backlog queued")
        send_frame(b, _dispatch(100, 1))
        _wait_until(lambda: server.runner.queued == 5, "B's DISPATCH queued")
        store.release(2)  # A1, then B: its start tag is the running job's, ahead of A's backlog
        _expect_result(b, 100, 1)
        assert store.finished == [1, 100]
        store.release(4)
        for tag in range(1, 6):
            _expect_result(a, tag, tag)
        assert store.finished == [1, 100, 2, 3, 4, 5]


def _sized_dispatch(tag: int, request_id: int, tokens: int) -> Frame:
    ids = torch.tensor([[0, 1]] * tokens)
    return Dispatch(0, torch.full((tokens, HIDDEN), float(tag)), ids, torch.rand(tokens, 2)).to_frame(request_id)


def test_the_compute_thread_is_shared_by_tokens_not_by_jobs():
    """Fair queuing by cost: B's two small DISPATCHes both run before A's second large one
    (round-robin by jobs would run A2 between them)."""
    store = FakeStore()
    with serving(store) as (server, address):
        a, b = _greeted(address), _greeted(address)
        send_frame(a, _sized_dispatch(1, 1, 50))
        _computing(store)
        for tag in (2, 3):
            send_frame(a, _sized_dispatch(tag, tag, 50))
        _wait_until(lambda: server.runner.queued == 2, "A's backlog queued")
        for tag in (101, 102):
            send_frame(b, _sized_dispatch(tag, tag, 2))
        _wait_until(lambda: server.runner.queued == 4, "B's DISPATCHes queued")
        store.release(5)
        for tag in (1, 2, 3):
            assert _recv(a).opcode == Opcode.RESULT
        for tag in (101, 102):
            assert _recv(b).opcode == Opcode.RESULT
        assert store.finished == [1, 101, 102, 2, 3]


def test_closed_connection_drops_its_queued_dispatches():
    store = FakeStore()
    with serving(store) as (server, address):
        a = _greeted(address)
        for tag in (1, 2, 3):
            send_frame(a, _dispatch(tag, tag))
        _computing(store)
        _wait_until(lambda: server.runner.queued == 2, "A's backlog queued")
        a.close()
        _wait_until(lambda: server.runner.queued == 0, "A's backlog dropped")
        store.release()  # A1 finishes; its RESULT has nowhere to go
        b = _greeted(address)
        send_frame(b, _dispatch(9, 4))
        store.release()
        _expect_result(b, 9, 4)
        assert store.calls == [1, 9]


# -- errors from compute ----------------------------------------------------------------------------


def test_compute_errors_become_error_replies_and_the_worker_goes_on():
    store = FakeStore(gated=False)
    with serving(store) as (_, address):
        sock = _greeted(address)
        send_frame(sock, _dispatch(1, 2, layer=BUGGY_LAYER))
        _expect_error(sock, 2, "internal", "RuntimeError: boom")
        send_frame(sock, _dispatch(1, 3, layer=BAD_LAYER))
        _expect_error(sock, 3, "bad_request",
                      "layer 1 is not served by this worker (it serves layer 0, experts 0-3)")
        frame = _dispatch(1, 4)
        send_frame(sock, dataclasses.replace(frame, meta={**frame.meta, "mode": "fancy"}))  # decoded off the loop
        _expect_error(sock, 4, "bad_request", "unknown combine mode 'fancy' (known: exact, partial)")
        send_frame(sock, _dispatch(5, 5))
        _expect_result(sock, 5, 5)


# -- broken framing closes one connection only -------------------------------------------------------


def _header(version=VERSION, opcode=Opcode.DISPATCH, request_id=3, meta_len=10, payload_len=0, magic=MAGIC) -> bytes:
    return HEADER.pack(magic, version, int(opcode), 0, request_id, meta_len, payload_len)


@pytest.mark.parametrize(
    "garbage, request_id, code, message",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 0, "framing", "bad magic b'GET ': not a moeswarm frame (expected b'MSWM')"),
        (_header(version=1), 0, "framing", f"unsupported protocol version 1 (this side speaks {VERSION})"),
        (_header(payload_len=4096), 0, "framing", "frame payload of 4096 bytes is over the limit of 1024"),
        (_header(meta_len=(1 << 20) + 1), 0, "framing",
         f"frame metadata of {(1 << 20) + 1} bytes is over the limit of {1 << 20}"),
        (_header()[:10], 0, "truncated", "truncated frame header: 10 of 24 bytes"),
        (_header(payload_len=100) + b"\x80" * 30, 3, "truncated", "truncated frame: body of 110 bytes, got 30"),
    ],
    ids=["magic", "version", "payload-limit", "meta-limit", "short-header", "short-body"],
)
def test_broken_framing_closes_only_that_connection(garbage, request_id, code, message):
    with serving(FakeStore(gated=False), max_payload=1024) as (_, address):
        good, bad = _greeted(address), _greeted(address)
        bad.sendall(garbage)
        bad.shutdown(socket.SHUT_WR)  # the truncated cases end there
        _expect_error(bad, request_id, code, message)
        with pytest.raises(StreamClosed, match=r"^connection closed after 0 of 24 bytes of the frame header$"):
            _recv(bad)
        send_frame(good, Frame(Opcode.PING, 8))
        assert _recv(good).opcode == Opcode.PONG
        send_frame(good, _dispatch(3, 9))
        _expect_result(good, 3, 9)


def test_a_body_that_stalls_is_cut_off():
    with serving(FakeStore(gated=False), frame_timeout_s=0.2) as (_, address):
        bad = _greeted(address)
        bad.sendall(_header(payload_len=100) + b"\x80" * 30)  # and nothing more, connection open
        _expect_error(bad, 3, "truncated", "truncated frame: body of 110 bytes not received within 0.2 s")
        with pytest.raises(StreamClosed, match=r"^connection closed after 0 of 24 bytes of the frame header$"):
            _recv(bad)


def test_unknown_opcode_keeps_the_connection_in_step():
    with serving(FakeStore(gated=False)) as (_, address):
        sock = _greeted(address)
        sock.sendall(_header(opcode=99, request_id=4, meta_len=1) + b"\x80")
        _expect_error(sock, 4, "bad_request", "unknown opcode 99")
        send_frame(sock, Frame(Opcode.PONG, 5))
        _expect_error(sock, 5, "bad_request", "unexpected opcode PONG from a client")
        send_frame(sock, Frame(Opcode.PING, 6))
        assert _recv(sock).opcode == Opcode.PONG


# -- shutting down --------------------------------------------------------------------------------------


def test_close_cancels_queued_work_and_stops_the_compute_thread():
    store = FakeStore()
    server = WorkerServer(store, FINGERPRINT, "fake")
    with running(server) as (loop, address):
        try:
            sock = _greeted(address)
            send_frame(sock, _dispatch(1, 2))
            send_frame(sock, _dispatch(2, 3))
            _computing(store)
            _wait_until(lambda: server.runner.queued == 1, "the second DISPATCH queued")
            closing = asyncio.run_coroutine_threadsafe(server.close(), loop)
            _wait_until(lambda: server.runner.queued == 0, "the queue emptied")
            assert not closing.done()  # it waits for the running job
            store.release()
            closing.result(WAIT_S)
        finally:
            store.release(10)
        assert not server.runner.running
        assert store.calls == [1]
        with pytest.raises(StreamClosed, match=r"^connection closed after 0 of 24 bytes of the frame header$"):
            _recv(sock)  # closed without a RESULT


SIGINT_SCRIPT = """
import asyncio, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from test_worker_runner import FINGERPRINT, FakeStore
from moeswarm.worker.server import WorkerServer

store = FakeStore()
server = WorkerServer(store, FINGERPRINT, "fake")

def when(condition, then):
    def wait():
        while not condition():
            time.sleep(0.005)
        then()
    threading.Thread(target=wait, daemon=True).start()

async def main():
    host, port = await server.start("127.0.0.1", 0)
    print(f"listening on {host}:{port}", flush=True)
    when(lambda: store.calls and server.runner.queued == 2, lambda: print("computing, 2 queued", flush=True))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve_forever())
    await stop.wait()
    when(lambda: server.runner.queued == 0, store.release)  # the running job ends while the server closes
    serving.cancel()

asyncio.run(main())
print(f"stopped, compute thread running: {server.runner.running}, runs: {store.calls}", flush=True)
"""


def test_sigint_during_compute_stops_cleanly():
    """The shutdown path of `moeswarm worker`: the signal cancels serve_forever while a job runs.

    asyncio.run cancels the closing server a second time on its way out; the compute thread must
    still be joined (a daemon thread cut off inside a torch kernel aborts the process).
    """
    process = subprocess.Popen([sys.executable, "-c", SIGINT_SCRIPT, os.path.dirname(__file__)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        host, port = process.stdout.readline().split("listening on ", 1)[1].split(":")
        sock = _greeted((host, int(port)))
        for request_id in (2, 3, 4):
            send_frame(sock, _dispatch(request_id, request_id))
        assert process.stdout.readline() == "computing, 2 queued\n"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=WAIT_S)
    finally:
        process.kill()
    assert (process.returncode, err) == (0, "")
    assert out == "stopped, compute thread running: False, runs: [2]\n"


# -- the real store ----------------------------------------------------------------------------------------


def test_real_store_on_the_compute_thread_matches_a_direct_run():
    """The bundled model's experts through the server's thread give the same bits as store.run here."""
    from moeswarm.bundled import TRAINED
    from moeswarm.sources.loading import load_experts
    from moeswarm.worker.store import ExpertStore

    if not (TRAINED / "model.safetensors").exists():
        pytest.skip("bundled pymoe model not present")
    hosted, source, num_experts = load_experts(TRAINED, layers=(0, 0))
    store = ExpertStore(hosted, num_experts, source.config.hidden_size)
    generator = torch.Generator().manual_seed(0)
    tokens, top_k = 16, source.config.num_experts_per_tok
    index = torch.rand(tokens, num_experts, generator=generator).argsort(dim=1)[:, :top_k]  # [T, k]
    request = Dispatch(0, torch.randn(tokens, store.hidden_size, generator=generator), index,
                       torch.rand(tokens, top_k, generator=generator))
    expected = store.run(request)
    with running(WorkerServer(store, source.fingerprint, source.config.model_type)) as (_, address):
        sock = _connect(address)
        send_frame(sock, Hello(source.fingerprint).to_frame(1))
        info = WorkerInfo.from_frame(_recv(sock))
        assert info.held == {0: tuple(range(num_experts))}
        send_frame(sock, request.to_frame(2))
        got = Result.from_frame(_recv(sock))
    assert (got.experts, got.counts) == (expected.experts, expected.counts)
    assert torch.equal(got.outputs, expected.outputs)
