"""Revoked members meet TLS: `moeswarm keygen --revoke` writes a list that every handshake reads.

Real processes: a worker holding the list refuses a revoked backbone (both sides name the member)
and serves an unrevoked one bit-identically; a backbone holding the list refuses a revoked worker.
In process: the list is re-read while a process runs, and an unreadable list refuses every member.
"""

from __future__ import annotations

import asyncio
import json
import select
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from moeswarm.local.workers import spawn_worker, stop, wait_listening
from moeswarm.transport.member_cert import read_revoked, revoke, write_member
from moeswarm.transport.tls import PeerRefused, client_context, server_context, write_swarm_key


def _moeswarm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """name -> member file (certified by one swarm key); 'revoked-backbone' and 'revoked-worker'
    revoked, and the list copied beside 'worker' and 'backbone' as an operator does."""
    where = tmp_path_factory.mktemp("members")
    swarm = where / "swarm.key"
    assert _moeswarm("keygen", "-o", str(swarm)).returncode == 0
    files = {}
    for name in ("worker", "backbone", "revoked-backbone", "revoked-worker"):
        files[name] = where / f"{name}.pem"
        made = _moeswarm("keygen", "--member", name, "--swarm-key", str(swarm), "-o", str(files[name]))
        assert made.returncode == 0, made.stderr
    for name in ("revoked-backbone", "revoked-worker"):
        revoked = _moeswarm("keygen", "--revoke", str(files[name]), "--swarm-key", str(swarm))
        assert revoked.returncode == 0 and f"revoked member {name} (serial" in revoked.stdout, revoked.stderr
    assert len(read_revoked(f"{swarm}.revoked")) == 2
    for name in ("worker", "backbone"):
        shutil.copy(f"{swarm}.revoked", f"{files[name]}.revoked")
    return files


def _serial(path) -> str:
    from cryptography import x509

    return f"{x509.load_pem_x509_certificates(path.read_bytes())[0].serial_number:x}"


@pytest.fixture(scope="module")
def worker(qwen2_moe, members):
    """A worker with its own member file and the list beside it: (address, process)."""
    process = spawn_worker(qwen2_moe, range(8), extra_args=("--swarm-key", str(members["worker"])))
    try:
        yield wait_listening(process), process
    finally:
        stop([process])


def _generate(model: str, address: str, key_file, *flags: str) -> subprocess.CompletedProcess:
    # one thread, as the worker computes: on the tiny model two threads choose other matmul kernels
    # for the local reference (logits 1e-6 apart at prefill), with or without TLS
    return _moeswarm("generate", "--model", model, "--workers", address, "--prompt", "def f(x):", "--threads", "1",
                     "--max-new-tokens", "4", "--swarm-key", str(key_file), *flags, timeout=180)


def _logged(process: subprocess.Popen, text: str, timeout_s: float = 30) -> str:
    """The first line of the process's stderr that contains `text` (waiting up to `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([process.stderr], [], [], deadline - time.monotonic())[0]:
            line = process.stderr.readline()
            if text in line:
                return line
    raise AssertionError(f"the worker never logged {text!r}")


def test_a_worker_serves_an_unrevoked_member_bit_identically(qwen2_moe, worker, members):
    run = _generate(qwen2_moe, worker[0], members["backbone"], "--check-local", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["bit_identical"] is True


def test_a_worker_refuses_a_revoked_backbone_and_both_name_it(qwen2_moe, worker, members):
    address, process = worker
    serial = _serial(members["revoked-backbone"])
    run = _generate(qwen2_moe, address, members["revoked-backbone"])
    assert run.returncode == 2
    assert run.stderr == (f"moeswarm generate: error: worker {address}: connection closed by the worker after the TLS "
                          f"handshake (is it down, or has this member, 'revoked-backbone' (serial {serial}), been revoked?)\n")
    assert f"TLS handshake: PeerRefused member 'revoked-backbone' (serial {serial}) is revoked" in _logged(process, "PeerRefused")


def test_a_backbone_refuses_a_revoked_worker_naming_it(qwen2_moe, members):
    process = spawn_worker(qwen2_moe, range(8), extra_args=("--swarm-key", str(members["revoked-worker"])))
    try:
        address = wait_listening(process)
        run = _generate(qwen2_moe, address, members["backbone"])
    finally:
        stop([process])
    serial = _serial(members["revoked-worker"])
    assert run.returncode == 2
    assert run.stderr == (f"moeswarm generate: error: worker {address}: TLS handshake failed (peer refused: member "
                          f"'revoked-worker' (serial {serial}) is revoked)\n")


# -- in process: the list as it changes ---------------------------------------------------------------------

@pytest.fixture
def tls_server(tmp_path):
    """A TLS echo server with member file 'w' of a new swarm; yields (port, swarm key, member files dir)."""
    swarm = write_swarm_key(tmp_path / "swarm.key")
    for name in ("w", "b"):
        write_member(swarm, name, tmp_path / f"{name}.pem")
    context = server_context(tmp_path / "w.pem")
    ready, loop_box = threading.Event(), {}

    async def echo(reader, writer):
        writer.write(await reader.read(5))
        await writer.drain()
        writer.close()

    async def serve():
        server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=context)
        loop_box["port"], loop_box["stop"] = server.sockets[0].getsockname()[1], asyncio.Event()
        ready.set()
        async with server:
            await loop_box["stop"].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield loop_box["port"], swarm, tmp_path
    loop.call_soon_threadsafe(loop_box["stop"].set)
    thread.join(10)


def _echo(port: int, context) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw) as tls:
            tls.sendall(b"hello")
            return tls.recv(5)


def test_the_list_is_read_again_while_a_process_runs(tls_server):
    port, swarm, where = tls_server
    context = client_context(where / "b.pem")  # one context for the whole run, as a backbone keeps it
    assert _echo(port, context) == b"hello"
    revoke(swarm, where / "w.pem")
    shutil.copy(f"{swarm}.revoked", where / "b.pem.revoked")
    time.sleep(1.1)  # the list is looked at again at most once a second
    with pytest.raises(PeerRefused, match=r"^peer refused: member 'w' \(serial [0-9a-f]+\) is revoked$"):
        _echo(port, context)


def test_an_unreadable_list_refuses_every_member(tls_server):
    port, _, where = tls_server
    (where / "b.pem.revoked").write_text("not-a-serial w\n")
    with pytest.raises(PeerRefused, match=r"^peer refused: cannot use the revocation list: .* line 1: 'not-a-serial' is not "):
        _echo(port, client_context(where / "b.pem"))


def test_the_swarm_key_itself_is_never_refused(tls_server):
    port, swarm, _ = tls_server
    # the server (member 'w') checks the client, which presents the swarm's own certificate: not a
    # member certificate, and no list can revoke it
    assert _echo(port, client_context(swarm)) == b"hello"
