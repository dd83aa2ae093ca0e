"""Connection budgets of a worker: TLS handshakes in progress hold a slot, each peer address has its
own cap, quiet connections give their slot to a newcomer once the worker is full (HELLO-only
peers cannot lock new backbones out), and accept failures are logged once per cause, never as a
traceback per connection.

In-process servers use test_worker_limits' ScaleStore; the accept-error test runs a real
`moeswarm worker` process under a low open-files limit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import ssl
import subprocess
import sys
import time

import pytest

from moeswarm.transport.tls import client_context, server_context, write_swarm_key
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import ErrorReply, Hello
from moeswarm.wire.stream import send_frame
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.server import WorkerServer
from test_worker_limits import (FINGERPRINT, ScaleStore, connect, expect_closed, expect_error, expect_result,
                                greeted, recv, request, wait_until)
from test_worker_runner import running

WAIT_S = 10.0


@contextlib.contextmanager
def serving(tls: ssl.SSLContext | None = None, **limits):
    server = WorkerServer(ScaleStore(), FINGERPRINT, "scale", WorkerLimits(**limits), tls=tls)
    with running(server) as (_, address):
        yield server, address


def tls_greeted(address, key) -> ssl.SSLSocket:
    sock = client_context(key).wrap_socket(socket.create_connection(address, timeout=WAIT_S))
    send_frame(sock, Hello(FINGERPRINT).to_frame(1))
    assert recv(sock).opcode == Opcode.HELLO
    return sock


def test_tls_handshakes_in_progress_hold_slots_until_the_hello_deadline(tmp_path, caplog):
    caplog.set_level(logging.INFO, "moeswarm.worker")
    key = write_swarm_key(tmp_path / "swarm.key")
    with serving(server_context(key), max_connections=3, hello_timeout_s=1.0, evict_after_s=60) as (server, address):
        started = time.monotonic()
        silent = [socket.create_connection(address, timeout=WAIT_S) for _ in range(3)]  # never start TLS
        wait_until(lambda: server.connections == 3)
        for _ in range(20):  # refused at once: closed before any handshake
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                tls_greeted(address, key)
        assert server.connections == 3
        wait_until(lambda: server.connections == 0)  # the HELLO deadline covers the handshake
        assert 0.9 <= time.monotonic() - started < 4.0
        sock = tls_greeted(address, key)
        sent = request()
        send_frame(sock, sent.to_frame(2))
        expect_result(sock, sent, 2)
        for s in silent:
            s.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "connections refused: over --max-connections (further ones are counted, not logged one by one)",
        "connections failed before a session began: TLS handshake: TimeoutError (further ones are counted, "
        "not logged one by one)",
    ]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_stalled_tls_handshake_makes_room_for_a_keyed_backbone(tmp_path, caplog):
    caplog.set_level(logging.INFO, "moeswarm.worker")
    key = write_swarm_key(tmp_path / "swarm.key")
    with serving(server_context(key), max_connections=2, evict_after_s=0.3) as (server, address):
        silent = [socket.create_connection(address, timeout=WAIT_S) for _ in range(2)]
        wait_until(lambda: server.connections == 2)
        time.sleep(0.4)
        greeted_ = []
        for rid in range(2):  # each takes the slot of a handshake that never began
            greeted_.append(tls_greeted(address, key))
            sent = request(seed=rid)
            send_frame(greeted_[-1], sent.to_frame(2))
            expect_result(greeted_[-1], sent, 2)
        assert server.table.evicted == 2 and server.connections == 2
        for s in silent + greeted_:
            s.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_the_hello_deadline_runs_from_accept_the_tls_handshake_included(tmp_path):
    key = write_swarm_key(tmp_path / "swarm.key")
    with serving(server_context(key), hello_timeout_s=1.0) as (_, address):
        started = time.monotonic()
        raw = socket.create_connection(address, timeout=WAIT_S)
        time.sleep(0.6)  # a slow handshake, then no HELLO
        sock = client_context(key).wrap_socket(raw)
        expect_error(sock, 0, "timeout", "no HELLO within 1 s: closing")
        assert time.monotonic() - started < 1.0 + 0.4


def test_each_peer_address_has_its_own_cap():
    with serving(max_connections_per_peer=2, evict_after_s=60) as (_, address):
        held = [greeted(address), greeted(address)]
        extra = connect(address)
        expect_error(extra, 0, "busy", "worker busy: 2 connections from your address open (limit 2 per address); "
                                       "retry later")
        expect_closed(extra)
        other = socket.socket()
        other.settimeout(WAIT_S)
        other.bind(("127.0.0.2", 0))  # another peer: its own share
        other.connect(address)
        send_frame(other, Hello(FINGERPRINT).to_frame(1))
        assert recv(other).opcode == Opcode.HELLO
        sent = request()
        send_frame(other, sent.to_frame(2))
        expect_result(other, sent, 2)
        for sock in [*held, other]:
            sock.close()


def test_hello_only_connections_give_their_slots_to_new_backbones():
    """A full worker: one busy backbone and three that sent HELLO (and PINGs) but nothing else. Each new
    backbone takes the slot of the quietest of those at once; the busy one is never closed."""
    with serving(max_connections=4, evict_after_s=0.5) as (server, address):
        busy = greeted(address)
        silent = [greeted(address) for _ in range(3)]
        newcomers = []
        for round_ in range(3):
            deadline = time.monotonic() + 0.6
            while time.monotonic() < deadline:  # the busy backbone computes, the silent ones only PING
                sent = request(seed=round_)
                send_frame(busy, sent.to_frame(10 + round_))
                expect_result(busy, sent, 10 + round_)
                for sock in silent[round_:]:
                    send_frame(sock, Frame(Opcode.PING, 5))
                    assert recv(sock).opcode == Opcode.PONG
                time.sleep(0.05)
            newcomers.append(greeted(address))
            sent = request(seed=20 + round_)
            send_frame(newcomers[-1], sent.to_frame(2))
            expect_result(newcomers[-1], sent, 2)
            assert server.connections == 4
        for sock in silent:  # each was told why, then closed
            reply = recv(sock)
            assert reply.opcode == Opcode.ERROR
            error = ErrorReply.from_frame(reply)
            assert error.code == "timeout" and error.message.startswith("closed to make room for a new connection: "
                                                                         "quiet for "), error
            expect_closed(sock)
        assert server.table.evicted == 3
        sent = request(seed=9)
        send_frame(busy, sent.to_frame(30))
        expect_result(busy, sent, 30)
        time.sleep(0.5)
        late = greeted(address)  # the newcomers went quiet meanwhile: the quietest of them makes room
        assert ErrorReply.from_frame(recv(newcomers[0])).code == "timeout"
        expect_closed(newcomers[0])
        for sock in (busy, late):
            sent = request(seed=31)
            send_frame(sock, sent.to_frame(31))
            expect_result(sock, sent, 31)


def test_accept_errors_are_logged_once_per_cause_without_tracebacks(qwen2_moe, tmp_path):
    """A real worker under an open-files limit of 160 meets a flood of 300 connections: accept fails
    with EMFILE again and again. stderr gets one line for it and no traceback; once the flood ends,
    a backbone is served."""
    from moeswarm.sources.source import open_source

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))

    log_path = tmp_path / "worker.err"
    with open(log_path, "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "moeswarm.cli", "worker", "--model", qwen2_moe, "--experts", "0-7", "--port", "0",
             "--threads", "1", "--max-connections-per-peer", "1000", "--max-connections", "1000"],
            stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=low_limit,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = process.stdout.readline()
        assert "listening on " in line, log_path.read_text()
        host, port = line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)
        address = (host, int(port))
        flood = []
        for _ in range(300):
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(address, timeout=WAIT_S))
        time.sleep(2.5)  # asyncio retries accept every second: several failures of the same cause
        for sock in flood:
            sock.close()
        deadline = time.monotonic() + 20
        while True:  # the backlog drains (each closed at once by its peer), then a backbone gets in
            try:
                sock = socket.create_connection(address, timeout=WAIT_S)
                send_frame(sock, Hello(open_source(qwen2_moe).fingerprint).to_frame(1))
                if recv(sock).opcode == Opcode.HELLO:
                    break
            except (OSError, EOFError):
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        sock.close()
    finally:
        process.terminate()
        process.wait(timeout=20)
    text = log_path.read_text()
    assert "Traceback" not in text, text
    accept_lines = [line.split(" WARNING ", 1)[-1] for line in text.splitlines() if "accept" in line]
    assert len(accept_lines) == len(set(accept_lines)) <= 2, text  # once per cause
    assert any("accept: OSError EMFILE (further ones are counted" in line for line in accept_lines), text
    assert len(text.splitlines()) < 10, text


def test_counted_log_reports_each_cause_once_then_its_count(caplog):
    from moeswarm.worker.admission import CountedLog

    caplog.set_level(logging.WARNING, "test.counted")
    counted = CountedLog(logging.getLogger("test.counted"), "accept failures", every_s=0.2)
    for _ in range(100):
        counted.note("OSError EMFILE")
    counted.note("TLS handshake: TimeoutError")
    counted.tick()  # not due yet: nothing more
    time.sleep(0.25)
    counted.tick()
    counted.tick()  # nothing new: nothing more
    assert [r.getMessage() for r in caplog.records] == [
        "accept failures: OSError EMFILE (further ones are counted, not logged one by one)",
        "accept failures: TLS handshake: TimeoutError (further ones are counted, not logged one by one)",
        "accept failures since the last report: OSError EMFILE x 99",
    ]
