"""The relay with identities: a name is registered only with its member's key, and a registered
worker is not displaced, starved or out-named.

A relay in a background thread; the honest worker is a real `RelayAttachment` (its server replaced
by one that answers every relayed connection with a word, so a backbone can tell who it reached);
squatters speak the relay protocol by hand, from 127.0.0.2 where the relay must tell hosts apart.
The attacks are issue 27's: a squatter with no key, another member's key, another swarm's key, the
honest certificate without its key, a revoked member; 8 idle registrations of the name; one peer
taking every name; a name's pipes exhausted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

import pytest

from moeswarm.transport.member_cert import Authority, Identity, revoke, write_member
from moeswarm.wire.relay import (CHALLENGE, CHALLENGE_BYTES, ERROR, OK, RelayError, challenge_bytes,
                                         encode_proof, encode_request)
from moeswarm.relay.server import RelayLimits, RelayServer
from moeswarm.relay.worker import RelayAttachment
from moeswarm.transport.tls import write_swarm_key


class Answering:
    """Stands in for a WorkerServer: a relayed connection gets `word`, then is held until the backbone closes."""

    def __init__(self, word: bytes):
        self.word = word

    async def serve_socket(self, sock: socket.socket) -> None:
        asyncio.ensure_future(self._answer(sock))

    async def _answer(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, self.word)
            while await loop.sock_recv(sock, 1024):
                pass
        finally:
            sock.close()


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    where = tmp_path_factory.mktemp("relay-members")
    swarm, other = write_swarm_key(where / "swarm.key"), write_swarm_key(where / "other.key")
    files = {name: write_member(swarm, name, where / f"{name}.pem") for name in ("gpu-1", "gpu-2", "evil")}
    files["stranger"] = write_member(other, "gpu-1", where / "stranger.pem")
    return swarm, {name: Identity.load(path) for name, path in files.items()}, files


@contextlib.contextmanager
def running(relay: RelayServer):
    """(the relay's (host, port), its loop) with the relay listening in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(relay.start("127.0.0.1", 0), loop).result(10), loop
    finally:
        asyncio.run_coroutine_threadsafe(_cancel_others(), loop).result(10)  # the attachments
        asyncio.run_coroutine_threadsafe(relay.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _cancel_others() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _until(condition, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        threading.Event().wait(0.05)
    return condition()


def _attach(where, loop, name: str, identity: Identity | None, word: bytes = b"honest", pool: int = 2):
    attachment = RelayAttachment(Answering(word), where, name, pool, identity)
    task = asyncio.run_coroutine_threadsafe(attachment.run(), loop)
    return attachment, task


def _registered(attachment: RelayAttachment, loop, timeout_s: float = 5.0) -> None:
    asyncio.run_coroutine_threadsafe(attachment.wait_registered(timeout_s), loop).result(timeout_s + 5)


def _connect(where, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect(where)
    return sock


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError(f"closed after {data!r}")
        data += chunk
    return data


def _register(where, name: str, prove=None, source: str = "127.0.0.1") -> tuple[socket.socket, str]:
    """A hand-made registration: (its socket, "ok" or the relay's error text). `prove(challenge)`
    gives the bytes answering a keyed relay's challenge."""
    sock = _connect(where, source)
    sock.sendall(encode_request(b"W", name))
    status = _recv_exactly(sock, 1)
    if status == CHALLENGE:
        challenge = _recv_exactly(sock, CHALLENGE_BYTES)
        sock.sendall(prove(challenge) if prove is not None else b"\x00\x00")
        status = _recv_exactly(sock, 1)
    if status == OK:
        return sock, "ok"
    assert status == ERROR, status
    (length,) = struct.unpack(">H", _recv_exactly(sock, 2))
    message = _recv_exactly(sock, length).decode()
    sock.close()
    return sock, message


def _proof(identity: Identity, name: str, certificate: bytes | None = None):
    return lambda challenge: encode_proof(certificate or identity.certificate_der,
                                          identity.sign(challenge_bytes(challenge, name)))


def _reach(where, name: str) -> bytes:
    """What a backbone asking the relay for `name` first receives from the worker (or the relay's error)."""
    with _connect(where) as sock:
        sock.sendall(encode_request(b"B", name))
        status = _recv_exactly(sock, 1)
        if status == ERROR:
            (length,) = struct.unpack(">H", _recv_exactly(sock, 2))
            return _recv_exactly(sock, length)
        assert status == OK
        return sock.recv(64)


def test_a_keyed_relay_registers_a_name_only_with_its_members_key(members):
    swarm, ids, files = members
    relay = RelayServer(RelayLimits(wait_for_worker_s=2.0), Authority.load(swarm))
    with running(relay) as (where, loop):
        honest, _ = _attach(where, loop, "gpu-1", ids["gpu-1"])
        _registered(honest, loop)
        squatters = [
            (None, "member certificate of 0 bytes (expected 1 to 2048)"),
            (_proof(ids["evil"], "gpu-1"),
             "cannot register gpu-1: the member certificate names 'evil' (a member registers its own name only)"),
            (_proof(ids["stranger"], "gpu-1"), "cannot register gpu-1: certificate not signed by this swarm's key"),
            (_proof(ids["evil"], "gpu-1", certificate=ids["gpu-1"].certificate_der),
             "cannot register gpu-1: the signature does not match the member certificate"),
        ]
        for prove, error in squatters:
            for _ in range(8):  # eight tries each: none is registered, none takes a backbone
                assert _register(where, "gpu-1", prove)[1] == error
        keyless, _ = _attach(where, loop, "gpu-1", None, word=b"squatter")
        with pytest.raises(RelayError, match="the relay registers members of a keyed swarm only: give --swarm-key"):
            _registered(keyless, loop, timeout_s=2.0)
        member, _ = _attach(where, loop, "gpu-1", ids["evil"], word=b"squatter")  # a worker of the swarm, another name
        with pytest.raises(RelayError, match="relay refused: cannot register gpu-1: the member certificate names 'evil'"):
            _registered(member, loop, timeout_s=2.0)

        assert [_reach(where, "gpu-1") for _ in range(3)] == [b"honest"] * 3
        assert _until(lambda: relay.idle_counts() == {"gpu-1": 2})  # the worker's pool, refilled; no squatter's

        assert _register(where, "gpu-2", _proof(ids["gpu-2"], "gpu-2"))[1] == "ok"
        revoke(swarm, files["gpu-2"])
        threading.Event().wait(1.1)  # the list is re-read at most once a second
        _, error = _register(where, "gpu-2", _proof(ids["gpu-2"], "gpu-2"))
        assert error.startswith("cannot register gpu-2: member 'gpu-2' (serial ") and error.endswith(") is revoked")


def test_eight_idle_registrations_do_not_keep_the_worker_out(members):
    """The name's own member may hold at most 8 idle connections: a restarted worker's new ones
    replace its stale ones, and backbones get the newest; nobody else can register the name."""
    swarm, ids, _ = members
    relay = RelayServer(RelayLimits(wait_for_worker_s=2.0), Authority.load(swarm))
    with running(relay) as (where, loop):
        stale = [_register(where, "gpu-1", _proof(ids["gpu-1"], "gpu-1")) for _ in range(8)]
        assert [reply for _, reply in stale] == ["ok"] * 8
        honest, _ = _attach(where, loop, "gpu-1", ids["gpu-1"], pool=2)
        _registered(honest, loop)
        assert relay.idle_counts() == {"gpu-1": 8}
        assert _reach(where, "gpu-1") == b"honest"
        for sock, _ in stale:
            sock.close()


def test_an_unkeyed_relay_binds_a_name_in_use_to_its_host():
    relay = RelayServer(RelayLimits(wait_for_worker_s=2.0))
    with running(relay) as (where, loop):
        honest, _ = _attach(where, loop, "gpu-1", None)
        _registered(honest, loop)
        for _ in range(8):
            assert _register(where, "gpu-1", source="127.0.0.2")[1] == (
                "name gpu-1 is in use by another host: a registered worker is not displaced")
        assert [_reach(where, "gpu-1") for _ in range(3)] == [b"honest"] * 3


def test_one_host_cannot_take_every_name():
    relay = RelayServer(RelayLimits())
    with running(relay) as (where, _):
        held = [_register(where, f"n{i}") for i in range(relay.limits.max_names_per_host)]
        assert [reply for _, reply in held] == ["ok"] * relay.limits.max_names_per_host
        assert _register(where, "one-more")[1] == "host 127.0.0.1 already registered 16 names here"
        other, reply = _register(where, "one-more", source="127.0.0.2")
        assert reply == "ok"
        for sock, _ in [*held, (other, reply)]:
            sock.close()


def test_a_names_pipes_are_capped(members):
    swarm, ids, _ = members
    relay = RelayServer(RelayLimits(wait_for_worker_s=2.0, max_pipes_per_name=2), Authority.load(swarm))
    with running(relay) as (where, loop):
        honest, _ = _attach(where, loop, "gpu-1", ids["gpu-1"], pool=4)
        _registered(honest, loop)
        pipes = []
        for _ in range(2):
            sock = _connect(where)
            sock.sendall(encode_request(b"B", "gpu-1"))
            assert _recv_exactly(sock, 1 + len(b"honest")) == b"K" + b"honest"
            pipes.append(sock)
        assert _reach(where, "gpu-1") == b"worker gpu-1 already has 2 pipes through this relay; retry later"
        pipes.pop().close()
        assert _until(lambda: relay.stats.pipes < 2)  # the relay sees the pipe end
        assert _reach(where, "gpu-1") == b"honest"
        for sock in pipes:
            sock.close()


def test_a_member_worker_through_a_keyed_relay_process_is_exact(qwen2_moe, members):
    """Real processes: `moeswarm relay --swarm-key` (a member file: it needs the swarm's certificate
    only) and a worker with its member file, registered under its member name by default; a backbone
    holding another member's file generates through it, bit for bit as local eager."""
    import subprocess
    import sys

    from moeswarm.engine.generate import generate
    from moeswarm.local.workers import spawn_worker, stop, wait_listening
    from moeswarm.sources.loading import load_local
    from moeswarm.swarm import open_swarm
    from moeswarm.transport.tls import client_context

    _, _, files = members
    relay = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "relay", "--host", "127.0.0.1",
                              "--swarm-key", str(files["evil"])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes = [relay]
    try:
        line = relay.stdout.readline()
        assert "moeswarm relay: listening on 127.0.0.1:" in line, relay.stderr.read()[-2000:]
        where = line.rsplit(" ", 1)[1].strip()
        worker = spawn_worker(qwen2_moe, range(8), extra_args=("--swarm-key", str(files["gpu-1"]), "--relay", where))
        processes.append(worker)
        wait_listening(worker)
        assert worker.stdout.readline().strip() == f"moeswarm worker: reachable through relay://{where}/gpu-1"
        with open_swarm(qwen2_moe, [f"relay://{where}/gpu-1"], tls=client_context(files["gpu-2"])) as swarm:
            result = generate(swarm, [72, 101, 108, 108, 111], 3, 0, load_local(qwen2_moe))
        assert result.bit_identical is True and len(result.tokens) == 3
    finally:
        relay.terminate()
        relay_log = relay.communicate(timeout=30)[1]
        stop(processes)
    assert "warning" not in relay_log  # keyed: no first-come names
