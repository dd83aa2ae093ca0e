"""Each worker limit answers with its exact ERROR, or closes; a well-behaved client is served meanwhile.

An in-process WorkerServer on a real socket (test_worker_runner's `running`) serving a small
store whose experts scale their rows (expert e: w * (e + 1) * x), so every RESULT is checked
against a computation here. The last test floods a real `moeswarm worker` process and bounds
its RSS (psutil).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time

import msgpack
import psutil
import pytest
import torch

from moeswarm.errors import ProtocolError
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER, HEADER_SIZE, MAGIC, VERSION, Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result
from moeswarm.wire.stream import StreamClosed, recv_frame, send_frame
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.server import WorkerServer
from test_worker_runner import running

FINGERPRINT = "hf-limits01"
HIDDEN = 64
EXPERTS = 4
WAIT_S = 10.0


class ScaleStore:
    """Layer 0, experts 0-3: expert e maps a row x to (e + 1) * x; optionally gated by permits."""

    num_experts = EXPERTS
    hidden_size = HIDDEN
    held = {0: tuple(range(EXPERTS))}

    def __init__(self, gated: bool = False, extra_rows: int = 0):
        self.gated = gated
        self.extra_rows = extra_rows  # a buggy store: returns more rows than the routing implies
        self.permits = threading.Semaphore(0)
        self.calls = 0

    def describe(self) -> str:
        return "layer 0, experts 0-3"

    def run(self, request: Dispatch) -> Result:
        self.calls += 1
        if self.gated and not self.permits.acquire(timeout=30):
            raise RuntimeError("test never released the store")
        index = request.top_k_index
        if ((index < -1) | (index >= EXPERTS)).any():
            raise ProtocolError("expert id out of range")
        result = expected_result(request)
        if self.extra_rows:
            outputs = torch.cat([result.outputs, torch.zeros(self.extra_rows, HIDDEN)])
            return Result(result.layer, result.mode, outputs, result.experts, result.counts, result.wire_combine)
        return result


def expected_result(request: Dispatch) -> Result:
    """What ScaleStore answers, computed here: per expert ascending, its rows in eager order."""
    hidden, index, weights = request.hidden, request.top_k_index, request.top_k_weights  # [T, d], [T, k], [T, k]
    hit = torch.unique(index[index >= 0]).tolist()
    blocks, counts = [], []
    for expert in hit:
        slots, tokens = torch.where(index.T == expert)  # [n_e] each, slot-major
        blocks.append(weights[tokens, slots].unsqueeze(1) * (expert + 1) * hidden[tokens])  # [n_e, d]
        counts.append(tokens.numel())
    outputs = torch.cat(blocks)  # [S, d]
    if request.mode == CombineMode.PARTIAL:
        rows = torch.cat([torch.where(index.T == e)[1] for e in hit])
        outputs = torch.zeros_like(hidden).index_add_(0, rows, outputs)  # [T, d]
        hit, counts = [], []
    return Result(request.layer, request.mode, outputs, hit, counts, request.wire_combine)


@contextlib.contextmanager
def serving(store: ScaleStore | None = None, **limits):
    store = store or ScaleStore()
    server = WorkerServer(store, FINGERPRINT, "scale", WorkerLimits(**limits))
    with running(server) as (loop, address):
        try:
            yield server, address
        finally:
            store.permits.release(1000)


def wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def connect(address, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(WAIT_S)
    sock.connect(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def greeted(address, rcvbuf: int | None = None) -> socket.socket:
    sock = connect(address, rcvbuf)
    send_frame(sock, Hello(FINGERPRINT).to_frame(1))
    assert recv(sock).opcode == Opcode.HELLO
    return sock


def recv(sock: socket.socket, wait_s: float = WAIT_S) -> Frame:
    return recv_frame(sock, time.monotonic() + wait_s)[0]


def request(tokens: int = 2, ids=None, layer: int = 0, seed: int = 0, **changes) -> Dispatch:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ids) if ids is not None else torch.tensor([[0, 2]] * tokens)
    tokens = ids.shape[0]
    fields = dict(hidden=torch.randn(tokens, HIDDEN, generator=generator), top_k_index=ids,
                  top_k_weights=torch.rand(*ids.shape, generator=generator))
    fields.update(changes)
    return Dispatch(layer, **fields)


def expect_result(sock: socket.socket, sent: Dispatch, request_id: int) -> Result:
    reply = recv(sock)
    assert (reply.opcode, reply.request_id) == (Opcode.RESULT, request_id), ErrorReply.from_frame(reply)
    got, want = Result.from_frame(reply), expected_result(sent)
    assert (got.experts, got.counts) == (want.experts, want.counts)
    assert torch.equal(got.outputs, want.outputs)
    return got


def expect_error(sock: socket.socket, request_id: int, code: str, message: str) -> None:
    reply = recv(sock)
    assert (reply.opcode, reply.request_id) == (Opcode.ERROR, request_id), reply
    assert ErrorReply.from_frame(reply) == ErrorReply(code, message)


def expect_closed(sock: socket.socket) -> None:
    with pytest.raises((StreamClosed, ConnectionResetError)):
        recv(sock)


def with_meta(frame: Frame, **changes) -> bytes:
    """A frame's bytes with metadata fields replaced."""
    return raw(frame.opcode, frame.request_id, {**frame.meta, **changes}, b"".join(bytes(p) for p in frame.parts))


def raw(opcode: int, request_id: int, meta: dict, payload: bytes = b"") -> bytes:
    """A frame written by hand: any metadata, any payload, lengths that match them."""
    packed = msgpack.packb(meta, use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, opcode, 0, request_id, len(packed), len(payload)) + packed + payload


class Flood:
    """One thread per socket sends `frame` again and again (every `pause_s`) and never reads;
    `stop` shuts the sockets."""

    def __init__(self, socks: list[socket.socket], frame: bytes, pause_s: float = 0.0):
        self.socks, self.frame, self.pause_s = socks, frame, pause_s
        self.sent = [0] * len(socks)
        self.threads = [threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(len(socks))]
        for thread in self.threads:
            thread.start()

    def _send(self, i: int) -> None:
        sock = self.socks[i]
        sock.settimeout(None)
        with contextlib.suppress(OSError):
            while True:
                sock.sendall(self.frame)
                self.sent[i] += len(self.frame)
                if self.pause_s:
                    time.sleep(self.pause_s)

    def stop(self) -> None:
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self.threads:
            thread.join(WAIT_S)


# -- connections -----------------------------------------------------------------------------------


def test_connections_over_the_limit_are_answered_busy_and_closed():
    with serving(max_connections=3) as (server, address):
        held = [greeted(address), greeted(address), connect(address)]
        extra = connect(address)
        expect_error(extra, 0, "busy", "worker busy: 3 connections open (limit 3); retry later")
        expect_closed(extra)
        held.pop().close()  # room again once one leaves
        deadline = time.monotonic() + WAIT_S
        while server.connections > 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock = greeted(address)
        sent = request()
        send_frame(sock, sent.to_frame(2))
        expect_result(sock, sent, 2)


# -- queues and the byte budget -------------------------------------------------------------------------


def test_queue_per_connection_answers_busy_and_other_connections_still_queue():
    store = ScaleStore(gated=True)
    with serving(store, queue_per_connection=2) as (server, address):
        a, b = greeted(address), greeted(address)
        sent = [request(seed=i) for i in range(5)]
        send_frame(a, sent[0].to_frame(10))
        wait_until(lambda: store.calls == 1)  # running: not counted as queued
        for i in (1, 2):
            send_frame(a, sent[i].to_frame(10 + i))
        deadline = time.monotonic() + WAIT_S
        while server.runner.queued < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        send_frame(a, sent[3].to_frame(13))
        expect_error(a, 13, "busy", "worker busy: 2 requests of this connection queued (limit 2); retry later")
        send_frame(b, sent[4].to_frame(20))  # another connection's queue is its own
        deadline = time.monotonic() + WAIT_S
        while server.runner.queued < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        store.permits.release(4)
        for i in range(3):
            expect_result(a, sent[i], 10 + i)
        expect_result(b, sent[4], 20)


def test_bodies_over_the_byte_budget_are_dropped_unread_and_answered_busy():
    store = ScaleStore(gated=True)
    with serving(store, max_buffered_bytes=1 << 20) as (server, address):
        sock = greeted(address)
        big = [request(tokens=2500, seed=i) for i in range(2)]  # ~660 KB each: one fits, two do not
        send_frame(sock, big[0].to_frame(2))
        send_frame(sock, big[1].to_frame(3))
        size = len(big[1].to_frame(3).to_bytes()) - HEADER_SIZE
        held = len(big[0].to_frame(2).to_bytes()) - HEADER_SIZE
        expect_error(sock, 3, "busy", f"worker busy: {held} bytes of requests held (limit {1 << 20}); retry later")
        assert size > (1 << 20) - held
        send_frame(sock, Frame(Opcode.PING, 4))  # the stream stayed in step: small frames always pass
        assert recv(sock).opcode == Opcode.PONG
        store.permits.release()
        expect_result(sock, big[0], 2)
        assert server.budget.held == 0


def test_a_closed_connection_gives_back_its_queue_and_budget():
    store = ScaleStore(gated=True)
    with serving(store) as (server, address):
        sock = greeted(address)
        for i in range(4):
            send_frame(sock, request(tokens=500, seed=i).to_frame(i + 2))
        wait_until(lambda: store.calls == 1 and server.runner.queued == 3)
        assert server.budget.held > 4 * 500 * HIDDEN * 4
        sock.close()
        wait_until(lambda: server.connections == 0 and server.runner.queued == 0)
        store.permits.release()  # the running one ends; its RESULT has nowhere to go
        wait_until(lambda: server.budget.held == 0)
        assert store.calls == 1


# -- what one DISPATCH may ask --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: request(tokens=9).to_frame(2).to_bytes(),
         "DISPATCH tensor 'x' has 9 tokens, over the limit of 8 (worker flag --max-tokens)"),
        (lambda: request(ids=[[0, 1, 2, 3, -1, -1, -1]]).to_frame(2).to_bytes(),
         "DISPATCH tensor 'ids' has top-k 7, over the limit of 6 (worker flag --max-top-k)"),
        (lambda: with_meta(request().to_frame(2), combine="i32"),
         "combine codec 'i32' cannot carry the experts' outputs "
         "(choose from f32, f16, bf16, int8-b32, int8-b64, int8-b128, fp8-b32, fp8-b64, fp8-b128)"),
        (lambda: with_meta(request().to_frame(2), combine="u8"),
         "combine codec 'u8' cannot carry the experts' outputs "
         "(choose from f32, f16, bf16, int8-b32, int8-b64, int8-b128, fp8-b32, fp8-b64, fp8-b128)"),
        (lambda: raw(Opcode.DISPATCH, 2, {**request().to_frame(2).meta, "tensors": [
            ["x", "f32", "f32", [0, 2**31 - 1]], ["ids", "u8", "u8", [0, 2]], ["w", "f32", "f32", [0, 2]]]}),
         "tensor 'x': shape [0, 2147483647] has no elements"),
        (lambda: raw(Opcode.DISPATCH, 2, {**request().to_frame(2).meta, "tensors": [
            ["x", "f32", "f32", [2, HIDDEN]], ["ids", "u8", "u8", [2, 0]], ["w", "f32", "f32", [2, 0]]]},
            bytes(2 * HIDDEN * 4)),
         "tensor 'ids': shape [2, 0] has no elements"),
    ],
    ids=["tokens", "top-k", "integer-combine-i32", "integer-combine-u8", "zero-tokens-huge-width",
         "zero-top-k"],
)
def test_dispatch_limits_answer_bad_request_and_nothing_is_computed(make, message):
    store = ScaleStore()
    with serving(store, max_tokens=8, max_top_k=6) as (_, address):
        sock = greeted(address)
        sock.sendall(make())
        expect_error(sock, 2, "bad_request", message)
        assert store.calls == 0
        sent = request()  # the connection goes on
        send_frame(sock, sent.to_frame(3))
        expect_result(sock, sent, 3)


def test_reply_is_no_larger_than_the_routing_implies():
    with serving(max_top_k=64) as (_, address):
        sock = greeted(address)
        # One token, top-k 64, four distinct held experts and the rest elsewhere: 4 rows back, no more.
        ids = [[3, 1, 0, 2] + [-1] * 60]
        sent = request(ids=ids)
        send_frame(sock, sent.to_frame(2))
        result = expect_result(sock, sent, 2)
        assert result.outputs.shape == (4, HIDDEN)
        partial = request(ids=ids, mode=CombineMode.PARTIAL)
        send_frame(sock, partial.to_frame(3))
        assert expect_result(sock, partial, 3).outputs.shape == (1, HIDDEN)


def test_a_reply_larger_than_its_routing_is_never_sent():
    with serving(ScaleStore(extra_rows=1)) as (_, address):
        sock = greeted(address)
        send_frame(sock, request().to_frame(2))  # 2 tokens x 2 experts: 4 rows; the buggy store makes 5
        expect_error(sock, 2, "internal", f"RuntimeError: RESULT of {5 * HIDDEN} values is over the "
                                          f"{4 * HIDDEN} its routing implies")


# -- before HELLO, deadlines, idle connections --------------------------------------------------------------


def test_frames_before_hello_are_small():
    with serving(hello_max_bytes=1024) as (_, address):
        sock = connect(address)
        sock.sendall(HEADER.pack(MAGIC, VERSION, Opcode.HELLO, 0, 1, 1025, 0))
        expect_error(sock, 1, "framing", "frame of 1025 bytes before HELLO is over the limit of 1024")
        expect_closed(sock)
        sock = greeted(address)  # after HELLO the payload limit applies
        sent = request(tokens=8)
        assert len(sent.to_frame(2).to_bytes()) > 1024
        send_frame(sock, sent.to_frame(2))
        expect_result(sock, sent, 2)


def test_a_header_that_stalls_is_cut_off():
    with serving(frame_timeout_s=0.3) as (_, address):
        sock = greeted(address)
        sock.sendall(Frame(Opcode.PING, 5).to_bytes()[:5])
        started = time.monotonic()
        expect_error(sock, 0, "truncated", "truncated frame header: not received within 0.3 s of its first byte")
        expect_closed(sock)
        assert time.monotonic() - started < 3


def test_no_hello_in_time_closes_the_connection():
    with serving(hello_timeout_s=0.3) as (_, address):
        sock = connect(address)
        expect_error(sock, 0, "timeout", "no HELLO within 0.3 s: closing")
        expect_closed(sock)
        slow = connect(address)  # a PING does not count as a HELLO
        send_frame(slow, Frame(Opcode.PING, 2))
        assert recv(slow).opcode == Opcode.PONG
        expect_error(slow, 0, "timeout", "no HELLO within 0.3 s: closing")


def test_an_idle_connection_is_closed_and_pings_do_not_renew_it():
    with serving(idle_timeout_s=0.4) as (_, address):
        sock = greeted(address)
        for rid in range(3):  # DISPATCHes keep it open
            time.sleep(0.2)
            sent = request(seed=rid)
            send_frame(sock, sent.to_frame(rid + 2))
            expect_result(sock, sent, rid + 2)
        started = time.monotonic()
        for rid in range(10):  # PINGs and HELLOs again are answered but renew nothing
            send_frame(sock, Hello(FINGERPRINT).to_frame(20 + rid) if rid % 2 else Frame(Opcode.PING, 20 + rid))
            reply = recv(sock)
            if reply.opcode == Opcode.ERROR:
                break
            assert reply.opcode == (Opcode.HELLO if rid % 2 else Opcode.PONG)
            time.sleep(0.1)
        assert ErrorReply.from_frame(reply) == ErrorReply("timeout", "no DISPATCH for 0.4 s (PINGs do not count): closing")
        assert time.monotonic() - started < 0.4 + 0.3
        expect_closed(sock)


# -- backpressure -------------------------------------------------------------------------------------------


def test_a_client_that_does_not_read_stops_being_read():
    """Pipelined DISPATCHes whose RESULTs are not read: the worker stops reading at the unsent bound.

    The queues take all 200 requests, so nothing is refused: only the bound stops the worker from
    reading (and computing, and holding) all of them. Each RESULT is 4x its DISPATCH's hidden
    states (four experts per token); the kernel's socket buffers take a few MB of them, then the
    worker holds at most the bound (each RESULT is counted before it is computed), and reads
    nothing more until the client reads.
    """
    store = ScaleStore()
    bound, total = 2 << 20, 200
    with serving(store, max_unsent_bytes=bound, queue_limit=total, queue_per_connection=total) as (server, address):
        sock = greeted(address, rcvbuf=32 << 10)
        sent = [request(tokens=256, ids=[[0, 1, 2, 3]] * 256, seed=i) for i in range(total)]  # 64 KB in, 1 MB out
        frames = [r.to_frame(10 + i).to_bytes() for i, r in enumerate(sent)]
        sender = threading.Thread(target=lambda: [sock.sendall(frame) for frame in frames], daemon=True)
        sender.start()
        calls, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 0.5:  # until the worker stops computing
            if store.calls != calls:
                calls, stable_since = store.calls, time.monotonic()
            time.sleep(0.05)
        unsent = max(session.unsent for session in server._sessions.values())
        reply = 256 * 4 * HIDDEN * 4 + 200
        assert calls < 40, calls
        assert unsent <= bound, (unsent, reply)
        replies = {}
        for _ in sent:  # now read: each request gets its RESULT, or "busy" (at once) when its queue was full
            frame = recv(sock)
            replies[frame.request_id] = frame
        assert sorted(replies) == [10 + i for i in range(total)]
        busy = 0
        for i, r in enumerate(sent):
            frame = replies[10 + i]
            if frame.opcode == Opcode.ERROR:
                assert ErrorReply.from_frame(frame).code == "busy"
                busy += 1
            else:
                assert torch.equal(Result.from_frame(frame).outputs, expected_result(r).outputs)
        sender.join(WAIT_S)
        assert store.calls + busy == total


# -- floods: a well-behaved client is still served ----------------------------------------------------------


def _round_trips(address, count: int) -> list[float]:
    sock = greeted(address)
    times = []
    for i in range(count):
        sent = request(seed=i)
        started = time.perf_counter()
        send_frame(sock, sent.to_frame(100 + i))
        expect_result(sock, sent, 100 + i)
        times.append(time.perf_counter() - started)
    sock.close()
    return times


def test_a_well_behaved_client_is_served_during_floods():
    """200 half-sent connections and two pipelining floods that never read: a good client still gets
    correct RESULTs, and the half-sent connections are cut at the frame deadline."""
    with serving(frame_timeout_s=1.5, max_unsent_bytes=128 << 10, max_connections_per_peer=256) as (server, address):
        before = _round_trips(address, 20)
        half_sent = []
        for _ in range(200):
            sock = connect(address)
            sock.sendall(Hello(FINGERPRINT).to_frame(1).to_bytes()[:5])
            half_sent.append(sock)
        started = time.monotonic()
        flood = Flood([greeted(address, rcvbuf=16 << 10) for _ in range(2)],
                      request(tokens=128, ids=[[0, 1, 2, 3]] * 128).to_frame(7).to_bytes())
        during = _round_trips(address, 20)
        for sock in half_sent:
            expect_error(sock, 0, "truncated", "truncated frame header: not received within 1.5 s of its first byte")
        assert time.monotonic() - started < 1.5 + 5
        assert server.connections <= 1 + 2
        flood.stop()
        assert max(during) < 2.0, during
        assert statistics.median(during) < max(20 * statistics.median(before), 0.05), (before, during)


def test_worker_rss_stays_bounded_under_unread_floods(tmp_path):
    """A real worker process: six clients pipeline DISPATCHes and never read.

    Each RESULT is 3.5 times its DISPATCH, and requests come slower than the worker computes them,
    so none is refused. Without backpressure the worker would compute every request and hold every
    RESULT (over 150 MB in 5 s); with it, its RSS grows by little, and what it grew is given back
    once the connections close.
    """
    from moeswarm_bench.bench.worker_process import spawn_worker
    from moeswarm.sources.source import open_source
    from moeswarm.model.tiny import make_tiny_model

    model = make_tiny_model("qwen2_moe", tmp_path / "qwen2_moe")
    fingerprint = open_source(model).fingerprint
    with spawn_worker(model, range(8), ["--max-unsent-bytes", str(1 << 20)]) as (address, process):
        worker = psutil.Process(process.pid)
        ids = torch.stack([torch.randperm(8)[:4] for _ in range(512)])  # [T, 4], four distinct held experts
        frame = Dispatch(0, torch.randn(512, 32), ids, torch.rand(512, 4)).to_frame(9).to_bytes()
        socks = []
        for _ in range(6):
            sock = socket.create_connection(address, timeout=WAIT_S)
            sock.sendall(Hello(fingerprint).to_frame(1).to_bytes())
            assert recv(sock).opcode == Opcode.HELLO
            socks.append(sock)
        baseline = worker.memory_info().rss
        flood = Flood(socks, frame, pause_s=0.03)  # slower than the worker computes: nothing is refused
        peak, deadline = baseline, time.monotonic() + 5
        while time.monotonic() < deadline:
            peak = max(peak, worker.memory_info().rss)
            time.sleep(0.1)
        sent = list(flood.sent)
        flood.stop()
        probe = socket.create_connection(address, timeout=WAIT_S)
        probe.sendall(Frame(Opcode.PING, 3).to_bytes())
        assert recv(probe).opcode == Opcode.PONG
        time.sleep(1.0)
        after = worker.memory_info().rss
    growth, kept = (peak - baseline) >> 20, (after - baseline) >> 20
    report = f"sent {sum(sent) >> 20} MB, RSS {baseline >> 20} MB, peak +{growth} MB, after +{kept} MB"
    assert growth < 60, report
    assert kept < 60, report
    print(report)
