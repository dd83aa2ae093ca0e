"""Replies are bounded before compute: top-k at most the model's, each RESULT's size counted against
its connection's bound and the worker's reply budget before any expert runs, a client that does
not read is cut off, and a real worker's RSS stays bounded under the amplification attack.

The in-process tests use test_worker_limits' ScaleStore (d 64, experts 0-3; expert e scales a
row by e + 1), so every RESULT is checked against a computation here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest

from moeswarm.errors import MoeSwarmError
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import Opcode
from moeswarm.wire.messages import ErrorReply
from moeswarm.wire.stream import send_frame
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.server import WorkerServer
from test_worker_limits import (FINGERPRINT, HIDDEN, ScaleStore, expect_closed, expect_error, expect_result,
                                expected_result, greeted, recv, request, wait_until)
from test_worker_runner import running

MiB = 1 << 20


@contextlib.contextmanager
def serving(store: ScaleStore | None = None, top_k: int | None = None, **limits):
    store = store or ScaleStore()
    server = WorkerServer(store, FINGERPRINT, "scale", WorkerLimits(**limits), top_k=top_k)
    with running(server) as (_, address):
        yield server, address


def held(server: WorkerServer) -> int:
    return sum(session.unsent for session in list(server._sessions.values()))


def test_top_k_over_the_models_is_refused_before_compute():
    store = ScaleStore()
    with serving(store, top_k=2) as (_, address):
        sock = greeted(address)
        send_frame(sock, request(ids=[[0, 1, 2]]).to_frame(2))
        expect_error(sock, 2, "bad_request", "DISPATCH tensor 'ids' has top-k 3, over the model's top-k of 2")
        assert store.calls == 0
        sent = request(ids=[[3, 1]])
        send_frame(sock, sent.to_frame(3))
        expect_result(sock, sent, 3)


def test_a_result_over_the_connections_bound_is_refused_at_its_exact_size_before_compute():
    store = ScaleStore()
    bound = 150_000
    with serving(store, max_unsent_bytes=bound, max_reply_bytes=bound) as (_, address):
        sock = greeted(address)
        send_frame(sock, request(ids=[[0, 1]] * 300).to_frame(2))  # 600 rows of 64 f32, 2 experts listed
        size = 600 * HIDDEN * 4 + 256 + 4 * 18  # metadata bounded for up to the 4 experts of the model
        expect_error(sock, 2, "bad_request", f"RESULT of {size} bytes would be over the limit of {bound} bytes a "
                                             "connection may hold unsent (worker flag --max-unsent-bytes): send fewer "
                                             "tokens per DISPATCH")
        assert store.calls == 0
        # The same shapes with half the slots routed elsewhere: the bound from the shapes is over the
        # limit, the exact size is not, and it is served.
        sent = request(ids=[[0, -1]] * 300)
        send_frame(sock, sent.to_frame(3))
        expect_result(sock, sent, 3)
        partial = request(ids=[[0, 1]] * 300, mode=CombineMode.PARTIAL)  # T rows in partial mode
        send_frame(sock, partial.to_frame(4))
        expect_result(sock, partial, 4)


def test_the_workers_reply_budget_answers_busy_and_small_replies_still_pass():
    budget = 10 * MiB
    with serving(max_unsent_bytes=int(8.5 * MiB), max_reply_bytes=budget) as (server, address):
        stuck = greeted(address, rcvbuf=4096)  # asks for an 8 MB RESULT and never reads it
        big = request(tokens=16000, ids=[[0, 1]] * 16000)
        send_frame(stuck, big.to_frame(2))
        wait_until(lambda: held(server) > 3 * MiB and all(s.owed == 0 for s in server._sessions.values()))
        other = greeted(address)
        send_frame(other, big.to_frame(3))
        reply = recv(other)
        assert (reply.opcode, reply.request_id) == (Opcode.ERROR, 3)
        error = ErrorReply.from_frame(reply)
        owed = 32000 * HIDDEN * 4 + 256 + 4 * 18
        assert error.code == "busy"
        assert error.message.startswith("worker busy: ")
        assert error.message.endswith(f"bytes of replies held and {owed} more asked (limit {budget}); retry later")
        small = request(seed=5)  # a decode step's RESULT: always within the budget
        send_frame(other, small.to_frame(4))
        expect_result(other, small, 4)
        stuck.close()
        wait_until(lambda: server.connections == 1 and held(server) == 0)
        send_frame(other, big.to_frame(5))  # room again
        expect_result(other, big, 5)


def test_a_client_that_takes_no_reply_is_cut_off_and_a_slow_reader_is_not(caplog):
    caplog.set_level(logging.WARNING, "moeswarm.worker")
    with serving(frame_timeout_s=1.0) as (server, address):
        slow = greeted(address, rcvbuf=256 << 10)
        sent = request(tokens=16000, ids=[[0, 1]] * 16000, seed=3)  # an 8 MB RESULT, read 512 KB every 0.2 s
        want = expected_result(sent).to_frame(3).to_bytes()
        got = bytearray()

        def read_slowly() -> None:
            while len(got) < len(want):
                chunk = slow.recv(512 << 10)
                if not chunk:
                    return
                got.extend(chunk)
                time.sleep(0.2)

        reader = threading.Thread(target=read_slowly, daemon=True)
        reader.start()
        send_frame(slow, sent.to_frame(3))
        stuck = greeted(address, rcvbuf=4096)
        send_frame(stuck, request(tokens=16000, ids=[[0, 1]] * 16000).to_frame(2))  # 8 MB too, never read
        started = time.monotonic()
        wait_until(lambda: server.connections == 1)
        assert 1.0 <= time.monotonic() - started < 4.0
        assert any("replies not taken for 1 s" in r.getMessage() for r in caplog.records)
        reader.join(30)
        assert bytes(got) == want  # the slow reader got its whole RESULT: taking bytes is progress
        assert server.connections == 1
        expect_closed(stuck)


def test_reply_budget_must_hold_one_connections_bound():
    with pytest.raises(MoeSwarmError, match=r"max-reply-bytes \(1000\) must be at least max-unsent-bytes \(2000\)"):
        WorkerLimits(max_unsent_bytes=2000, max_reply_bytes=1000)


def test_a_real_workers_rss_stays_bounded_under_the_amplification_attack():
    """48 connections each ask for a 16 MB RESULT (every slot the same held expert) and never read;
    the worker's budgets are 32 MB of bodies and 32 MB of replies. Its RSS grows by at most a
    couple of hundred MB (bodies, replies and one job's compute), a well-behaved client is served
    throughout, and what grew is given back once the attackers close."""
    from moeswarm_bench.bench.amplification import run_amplification

    budgets = ("--max-unsent-bytes", str(16 * MiB), "--max-reply-bytes", str(32 * MiB),
               "--max-buffered-bytes", str(32 * MiB), "--frame-timeout", "2")
    result = run_amplification(connections=48, tokens=4090, top_k=8, hold_s=4.0, worker_args=budgets)
    growth, kept = result["rss_peak_mb"] - result["rss_before_mb"], result["rss_after_mb"] - result["rss_before_mb"]
    assert growth < 200, result
    assert kept < 40, result
    assert set(result["good_client"]) == {"result"}, result
