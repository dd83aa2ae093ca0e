"""The swarm key: workers and backbones that hold it talk over mutual TLS; anyone else gets nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from moeswarm.local.workers import local_workers, split_experts
from moeswarm.wire.frames import MAGIC


def _moeswarm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    where = tmp_path_factory.mktemp("keys")
    for name in ("swarm.key", "other.key"):
        made = _moeswarm("keygen", "-o", str(where / name))
        assert made.returncode == 0, made.stderr
    return where / "swarm.key", where / "other.key"


@pytest.fixture(scope="module")
def tls_workers(qwen2_moe, keys):
    with local_workers(qwen2_moe, split_experts(8, 2), extra_args=("--swarm-key", str(keys[0]))) as addresses:
        yield addresses


def test_keygen_writes_a_private_file_and_never_overwrites(keys):
    assert keys[0].stat().st_mode & 0o777 == 0o600
    again = _moeswarm("keygen", "-o", str(keys[0]))
    assert again.returncode == 2 and "already exists" in again.stderr and len(again.stderr.splitlines()) == 1


def test_generation_with_the_key_is_bit_identical(qwen2_moe, tls_workers, keys):
    # --threads 1, as the workers: a float matrix product of some row counts (9 here) splits its sums
    # differently on 2 threads, and the local reference computes the experts with the backbone's threads
    run = _moeswarm("generate", "--model", qwen2_moe, "--workers", ",".join(tls_workers), "--prompt", "def f(x):",
                    "--max-new-tokens", "6", "--check-local", "--json", "--swarm-key", str(keys[0]), "--threads", "1")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["bit_identical"] is True


@pytest.mark.parametrize("key_flags", [(), ("--swarm-key", "OTHER")])
def test_a_backbone_without_the_key_is_refused_in_one_line(qwen2_moe, tls_workers, keys, key_flags):
    flags = tuple(str(keys[1]) if f == "OTHER" else f for f in key_flags)
    run = _moeswarm("generate", "--model", qwen2_moe, "--workers", tls_workers[0] + "," + tls_workers[1],
                    "--prompt", "x", "--max-new-tokens", "2", *flags, timeout=120)
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and tls_workers[0] in run.stderr


def test_a_plain_peer_gets_nothing_of_the_protocol(tls_workers):
    host, port = tls_workers[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as plain:
        plain.sendall(MAGIC + bytes(60))  # the start of a HELLO, in the clear
        received = b""
        try:
            while chunk := plain.recv(4096):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert MAGIC not in received  # at most a TLS alert: no frame, not even an ERROR


def test_a_worker_listening_beyond_loopback_without_a_key_warns(qwen2_moe):
    worker = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "worker", "--model", qwen2_moe, "--host", "0.0.0.0",
                               "--port", "0", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker.stdout.readline()  # it listens
    finally:
        worker.terminate()
        _, err = worker.communicate(timeout=30)
    assert "without --swarm-key" in err
