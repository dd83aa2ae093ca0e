"""The relay: a worker that cannot be dialled is reached through it, with TLS end to end.

The end-to-end test puts the worker in a network namespace made here (addresses inside the
sandbox only): it can dial the relay on the host's side of a veth pair, but its own listening
address is not reachable from the backbone, so the path policy must choose the relay; the
generation is compared with local eager step by step (torch.equal). A relay that alters a byte
breaks the TLS record: the link fails and the dispatcher fails over, never a wrong result.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from moeswarm.errors import WorkerError
from moeswarm.engine.generate import generate
from moeswarm.local.workers import spawn_worker, stop, wait_listening
from moeswarm.sources.loading import load_local
from moeswarm.transport.path import choose_path, parse_worker, probe
from moeswarm.wire.relay import (MAGIC, RelayError, encode_request, parse_relay_address,
                                         parse_request_head)
from moeswarm.relay.server import CHUNK, RelayLimits, RelayServer
from moeswarm.swarm import open_swarm
from moeswarm.transport.relay import RelayLink
from moeswarm.transport.tls import client_context, write_swarm_key
from netns import namespace  # noqa: F401  (a fixture)

PROMPT = [72, 101, 108, 108, 111, 44, 32]
NEW_TOKENS = 4


def _moeswarm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    return write_swarm_key(tmp_path_factory.mktemp("relay") / "swarm.key")


@pytest.fixture(scope="module")
def reference(qwen2_moe):
    return load_local(qwen2_moe)


@contextlib.contextmanager
def relay_thread(relay: RelayServer, host: str = "127.0.0.1"):
    """`relay` listening on a loop in a background thread; yields its "HOST:PORT"."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        bound = asyncio.run_coroutine_threadsafe(relay.start(host, 0), loop).result(10)
        yield "%s:%d" % bound
    finally:
        asyncio.run_coroutine_threadsafe(relay.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _worker_route(process: subprocess.Popen) -> str:
    """The relay://... route a worker started with --relay prints after its listening line."""
    line = process.stdout.readline()
    assert "reachable through relay://" in line, line + process.stderr.read()[-2000:]
    return line.split("reachable through ", 1)[1].strip()


def test_handshake_bytes_are_pinned_and_checked():
    assert encode_request(b"W", "gpu-1") == b"MSR1W\x05gpu-1"
    assert parse_request_head(b"MSR1B\x05") == (b"B", 5)
    for head, error in [(b"HTTP/1", "bad magic"), (b"MSR1X\x05", "unknown relay role"), (b"MSR1W\x00", "out of range"),
                        (b"MSR1W\x41", "out of range")]:
        with pytest.raises(RelayError, match=error):
            parse_request_head(head)
    with pytest.raises(RelayError, match="bad relay name"):
        encode_request(b"W", "no spaces")


def test_worker_specs_parse_or_name_what_is_wrong():
    assert parse_worker("10.0.0.2:7000") == ("10.0.0.2:7000", None)
    assert parse_worker("relay://r.example:9000/gpu-1") == (None, "relay://r.example:9000/gpu-1")
    assert parse_worker("10.0.0.2:7000+relay://r:9000/w") == ("10.0.0.2:7000", "relay://r:9000/w")
    assert parse_relay_address("relay://r:9000/w") == ("r", 9000, "w")
    for bad, error in [("relay://r:9000", "expected relay://HOST:PORT/NAME"), ("relay://r:x/w", "expected HOST:PORT"),
                       ("h:1+r:9000/w", "after '\\+' comes relay://"), ("relay://r:1/a b", "bad relay name")]:
        with pytest.raises(ValueError, match=error):
            parse_worker(bad)
    run = _moeswarm("generate", "--model", "x", "--workers", "h:1+relay://r:9/bad name", "--prompt", "x")
    assert run.returncode == 2 and "bad relay name" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    run = _moeswarm("worker", "--model", "x", "--relay", "r:9", "--relay-name", "x/y")
    assert run.returncode == 2 and "bad relay name" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_the_relay_refuses_bad_requests_in_one_line_and_keeps_serving():
    limits = RelayLimits(max_idle_per_name=1, wait_for_worker_s=0.2, handshake_timeout_s=0.5)
    relay = RelayServer(limits)
    with relay_thread(relay) as where:
        host, port = where.rsplit(":", 1)

        def ask(raw: bytes) -> bytes:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(raw)
                return sock.recv(1024)

        assert ask(b"GET / HTTP/1.1\r\n\r\n") == b"E\x00\x28not a moeswarm relay request (bad magic)"
        assert ask(MAGIC)[3:] == b"no relay request within 0.5 s"  # a partial request times out
        with socket.create_connection((host, int(port)), timeout=5) as idle, \
                socket.create_connection((host, int(port)), timeout=5) as newer:
            idle.sendall(encode_request(b"W", "w1"))
            assert idle.recv(1) == b"K"
            newer.sendall(encode_request(b"W", "w1"))  # the name is full: its owner's newest replaces its oldest
            assert newer.recv(1) == b"K"
            assert idle.recv(1) == b""  # closed by the relay
            assert relay.idle_counts() == {"w1": 1}
        link = RelayLink(f"relay://{where}/ghost")
        with pytest.raises(WorkerError, match="no worker named ghost is registered at this relay"):
            link.connect("fingerprint")
        with pytest.raises(WorkerError, match="cannot connect to relay 127.0.0.1:1"):
            RelayLink("relay://127.0.0.1:1/w").connect("fingerprint")


class TamperingRelay(RelayServer):
    """Flips the last byte of the first chunk that takes the worker-to-backbone direction past
    `after` bytes."""

    def __init__(self, after: int):
        super().__init__(RelayLimits(wait_for_worker_s=10.0))
        self.after, self.flipped = after, 0
        self._to_backbone: set[object] = set()

    async def _splice(self, a_reader, a_writer, b_reader, b_writer) -> None:
        self._to_backbone.add(a_writer)  # a: the backbone's connection, b: the worker's
        await super()._splice(a_reader, a_writer, b_reader, b_writer)

    async def _pump(self, reader, writer, moved) -> None:
        seen = 0
        while data := await reader.read(CHUNK):
            seen += len(data)
            if writer in self._to_backbone and not self.flipped and seen > self.after:
                data = data[:-1] + bytes([data[-1] ^ 0x01])
                self.flipped += 1
            writer.write(data)
            moved[0] = time.monotonic()
            await writer.drain()


def test_a_relay_that_alters_a_byte_fails_the_link_and_the_results_stay_exact(qwen2_moe, key, reference, tmp_path):
    other_key = write_swarm_key(tmp_path / "other.key")
    tampering = TamperingRelay(after=2_400)  # past the TLS handshake and the HELLO answer (2,233 bytes): the prefill
    with relay_thread(tampering) as where:
        worker = spawn_worker(qwen2_moe, range(8), extra_args=("--swarm-key", str(key), "--relay", where))
        try:
            direct = wait_listening(worker)
            route = _worker_route(worker)
            tls = client_context(key)
            assert choose_path(direct, route, 2.0, tls)[0] == "direct"  # it answers its PING directly
            assert probe(direct, 2.0, client_context(other_key)) is False  # not with another swarm's key
            with open_swarm(qwen2_moe, [route, direct], tls=tls, reply_timeout_s=10.0) as swarm:
                assert swarm.accounting()["worker_paths"] == {route: "relay", direct: "direct"}
                result = generate(swarm, PROMPT, NEW_TOKENS, 0, reference)
                stats = swarm.resilience()
            # A backbone without the key gets nothing through the relay either (it flips no more bytes).
            with pytest.raises(WorkerError, match="TLS handshake failed"):
                RelayLink(route, client_context(other_key)).connect("fingerprint", timeout_s=10)
            with pytest.raises(WorkerError, match=route):
                RelayLink(route, None).connect("fingerprint", timeout_s=5)  # plain frames into the worker's TLS
        finally:
            stop([worker])
    assert tampering.flipped == 1
    assert result.bit_identical is True and len(result.tokens) == NEW_TOKENS
    assert stats["takedowns"] >= 1 and stats["failovers"] >= 1


def test_a_worker_that_cannot_be_dialled_is_reached_through_the_relay(qwen2_moe, key, reference, namespace):
    relay = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "relay", "--host", namespace.here, "--port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        relay_at = relay.stdout.readline().split("listening on ", 1)[1].split()[0]
        worker = subprocess.Popen(
            ["ip", "netns", "exec", namespace.name, sys.executable, "-m", "moeswarm.cli", "worker", "--model", qwen2_moe,
             "--host", namespace.inside, "--port", "0", "--threads", "1", "--swarm-key", str(key), "--relay", relay_at,
             "--relay-name", "behind-nat"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        direct = wait_listening(worker)
        route = _worker_route(worker)
        assert direct.startswith(namespace.inside) and route == f"relay://{relay_at}/behind-nat"
        tls = client_context(key)
        assert probe(direct, 1.0, tls) is False  # the worker's own address cannot be dialled from here
        kind, link = choose_path(direct, route, 1.0, tls)
        assert kind == "relay" and isinstance(link, RelayLink)
        with open_swarm(qwen2_moe, [f"{direct}+{route}"], tls=tls) as swarm:
            assert swarm.workers == [route] and swarm.accounting()["worker_paths"] == {route: "relay"}
            result = generate(swarm, PROMPT, NEW_TOKENS, 0, reference)
        assert result.bit_identical is True and len(result.tokens) == NEW_TOKENS
    finally:
        stop([p for p in (worker, relay) if p is not None])
