"""A worker closes the connection of a member revoked while connected (issue 62): the list is
re-read as it changes and every connection's certificate checked again, not only new handshakes'."""

from __future__ import annotations

import shutil
import socket
import time

from moeswarm.sources.source import open_source
from moeswarm.local.workers import spawn_worker, stop, wait_listening
from moeswarm.transport.member_cert import revoke, write_member
from moeswarm.transport.tls import client_context, write_swarm_key
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.messages import Hello
from moeswarm.wire.stream import recv_frame, send_frame


def test_a_worker_closes_a_member_revoked_while_connected(qwen2_moe, tmp_path):
    swarm = write_swarm_key(tmp_path / "swarm.key")
    for name in ("worker", "backbone"):
        write_member(swarm, name, tmp_path / f"{name}.pem")
    process = spawn_worker(qwen2_moe, range(8), extra_args=("--swarm-key", str(tmp_path / "worker.pem")))
    try:
        host, port = wait_listening(process).rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=30)
        sock = client_context(tmp_path / "backbone.pem").wrap_socket(raw, server_hostname=host)
        send_frame(sock, Hello(open_source(qwen2_moe).fingerprint).to_frame(1))
        assert recv_frame(sock, time.monotonic() + 30)[0].opcode == Opcode.HELLO
        revoke(swarm, tmp_path / "backbone.pem")
        shutil.copy(f"{swarm}.revoked", tmp_path / "worker.pem.revoked")  # beside the worker's key, as an operator does
        started, closed = time.monotonic(), False
        while time.monotonic() - started < 10 and not closed:
            try:
                send_frame(sock, Frame(Opcode.PING, 2))
                closed = recv_frame(sock, time.monotonic() + 10)[0].opcode != Opcode.PONG
            except OSError:  # ssl.SSLError and connection errors alike
                closed = True
            time.sleep(0.2)
        assert closed and time.monotonic() - started < 5.0
        sock.close()
    finally:
        stop([process])
