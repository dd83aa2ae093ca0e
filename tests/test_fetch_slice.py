"""A joining worker fetches only its slice: manifest, seeder, fetch-slice.

The seeder runs on a background event loop of this process (real TCP, TLS with a swarm key), the
fetcher as `moeswarm fetch-slice` (a process killed mid-way) or its function. Every fetched slice
must be byte for byte the file `moeswarm slice` writes from the whole model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moeswarm_bench.bench.fetch_slice import make_random_gguf
from moeswarm.slices.manifest import ManifestError, build_manifest, load_manifest, write_manifest
from moeswarm.slices.seed import Seeder
from moeswarm.slices.fetch import FetchError, fetch_slice
from moeswarm.slices.protocol import RESPONSE, encode_request
from moeswarm.transport.tls import client_context, server_context, write_swarm_key
from moeswarm_bench.wan import LinkProfile, WanProxy
from moeswarm.gguf.gguf_slice import write_slice

EXPERTS = [2, 3, 4, 5]
CHUNK = 16 << 10  # small pieces: many requests, and a fetch that can be cut in the middle
WAIT_S = 60.0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fetch")
    model = make_random_gguf(tmp / "model.gguf", 3.0, experts=16, layers=3, hidden=64)
    digest = write_manifest(build_manifest(model, CHUNK), tmp / "model.manifest.json")
    write_slice(model, tmp / "expected.gguf", EXPERTS)
    write_slice(model, tmp / "expected-backbone.gguf", EXPERTS, (1, 2), with_backbone=True)
    write_swarm_key(tmp / "swarm.key")
    write_swarm_key(tmp / "other.key")
    return {"tmp": tmp, "model": model, "manifest": tmp / "model.manifest.json", "sha256": digest,
            "key": tmp / "swarm.key", "other": tmp / "other.key"}


class Loop:
    """An event loop on a daemon thread, for seeders and proxies."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(WAIT_S)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


@pytest.fixture
def loop():
    running = Loop()
    yield running
    running.close()


@contextlib.contextmanager
def seeding(loop: Loop, path, key=None, bandwidth_bps: float | None = None):
    """A seeder of `path` (TLS when `key`), optionally behind a WanProxy at `bandwidth_bps`; yields (address, seeder)."""
    seeder = Seeder(path, server_context(key) if key else None)
    host, port = loop.call(seeder.start("127.0.0.1", 0))
    proxy = None
    try:
        if bandwidth_bps is not None:
            proxy = WanProxy(("127.0.0.1", 0), (host, port), LinkProfile(rtt_s=0.0, bandwidth_bps=bandwidth_bps))
            loop.call(proxy.start())
            host, port = proxy.address
        yield f"{host}:{port}", seeder
    finally:
        if proxy is not None:
            loop.call(proxy.close())
        loop.call(seeder.close())


def _same(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def test_fetched_slice_is_what_slice_writes_over_tls(files, loop, tmp_path):
    manifest = load_manifest(files["manifest"], files["sha256"])
    with seeding(loop, files["model"], files["key"]) as (address, seeder):
        report = fetch_slice(address, manifest, EXPERTS, tmp_path / "part.gguf", tls=client_context(files["key"]))
        assert _same(tmp_path / "part.gguf", files["tmp"] / "expected.gguf")
        assert report["resumed_bytes"] == 0 and report["fetched_bytes"] < files["model"].stat().st_size / 3
        fetch_slice(address, manifest, EXPERTS, tmp_path / "both.gguf", (1, 2), True, client_context(files["key"]))
        assert _same(tmp_path / "both.gguf", files["tmp"] / "expected-backbone.gguf")
    assert sorted(os.listdir(tmp_path)) == ["both.gguf", "part.gguf"]  # no partial files left
    assert seeder.sent_bytes < 2 * files["model"].stat().st_size / 3


def test_fetch_killed_then_seeder_lost_resumes_each_time(files, loop, tmp_path):
    out = tmp_path / "part.gguf"
    record = tmp_path / "part.gguf.partial.done"
    with seeding(loop, files["model"], files["key"], bandwidth_bps=2e6) as (address, _):
        fetcher = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "fetch-slice", address, "--manifest",
                                    str(files["manifest"]), "--experts", "2-5", "-o", str(out), "--swarm-key",
                                    str(files["key"]), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _wait_until(lambda: record.is_file() and len(record.read_text().splitlines()) > 4, "pieces recorded")
            os.kill(fetcher.pid, signal.SIGKILL)
        finally:
            fetcher.communicate(timeout=WAIT_S)
    assert fetcher.returncode == -signal.SIGKILL and not out.exists()
    kept = len(record.read_text().splitlines()) - 1
    manifest = load_manifest(files["manifest"])
    with seeding(loop, files["model"], files["key"], bandwidth_bps=2e6) as (address, seeder):
        def lose_seeder() -> None:  # the seeder goes away once a few more pieces came
            _wait_until(lambda: len(record.read_text().splitlines()) - 1 > kept + 4, "more pieces")
            loop.call(seeder.close())

        cutter = threading.Thread(target=lose_seeder)
        cutter.start()
        with pytest.raises(FetchError, match=r"seeder .*: .*run the same command again to resume"):
            fetch_slice(address, manifest, EXPERTS, out, tls=client_context(files["key"]), retries=0)
        cutter.join(WAIT_S)
    assert not out.exists()
    with seeding(loop, files["model"], files["key"]) as (address, _):
        report = fetch_slice(address, manifest, EXPERTS, out, tls=client_context(files["key"]))
    assert report["resumed_bytes"] > 0 and report["fetched_bytes"] > 0
    assert _same(out, files["tmp"] / "expected.gguf")


def test_lying_seeder_is_caught_naming_the_piece(files, loop, tmp_path):
    manifest = load_manifest(files["manifest"])
    tampered = tmp_path / "tampered.gguf"
    data = bytearray(files["model"].read_bytes())
    tensor = next(t for t in manifest.data["tensors"] if t["name"] == "blk.1.ffn_up_exps.weight")
    block = tensor["bytes"] // len(tensor["units"])
    data[tensor["offset"] + 3 * block + 100] ^= 0x01  # one bit of expert 3
    tampered.write_bytes(bytes(data))
    with seeding(loop, tampered) as (address, _):
        with pytest.raises(FetchError) as caught:
            fetch_slice(address, manifest, EXPERTS, tmp_path / "part.gguf")
    message = str(caught.value)
    assert "blk.1.ffn_up_exps.weight expert 3" in message and "does not match the owner's manifest" in message
    assert "\n" not in message and not (tmp_path / "part.gguf").exists()
    other = make_random_gguf(tmp_path / "other.gguf", 0.5, experts=16, layers=3, hidden=64, seed=1)
    with seeding(loop, other) as (address, _):
        with pytest.raises(FetchError, match=r"sent header .* it serves another file"):
            fetch_slice(address, manifest, EXPERTS, tmp_path / "other-part.gguf")


def test_unauthenticated_peers_are_refused(files, loop, tmp_path):
    manifest = load_manifest(files["manifest"])
    with seeding(loop, files["model"], files["key"]) as (address, seeder):
        with pytest.raises(FetchError, match="pass the same --swarm-key"):  # plain TCP to a TLS seeder
            fetch_slice(address, manifest, EXPERTS, tmp_path / "a.gguf", retries=0)
        with pytest.raises(FetchError, match="TLS handshake failed .* same --swarm-key"):
            fetch_slice(address, manifest, EXPERTS, tmp_path / "b.gguf", tls=client_context(files["other"]))
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:  # no TLS: not one byte of the file
            raw.sendall(encode_request(0, 4096))
            assert raw.recv(1 << 16) == b""
        assert seeder.sent_bytes == 0
    with seeding(loop, files["model"]) as (address, _):  # a TLS fetcher refuses a seeder without the key
        with pytest.raises(FetchError, match="TLS handshake failed"):
            fetch_slice(address, manifest, EXPERTS, tmp_path / "c.gguf", tls=client_context(files["key"]))


def test_seeder_bounds_requests_and_keeps_serving(files, loop):
    size = files["model"].stat().st_size
    with seeding(loop, files["model"]) as (address, _):
        host, port = address.rsplit(":", 1)
        for offset, length, error in [(size - 10, 11, f"bytes [{size - 10}, {size + 1}) lie beyond the file's {size} bytes"),
                                      (0, (16 << 20) + 1, f"a request may ask for 1 to {16 << 20} bytes, not {(16 << 20) + 1}"),
                                      (0, 0, f"a request may ask for 1 to {16 << 20} bytes, not 0")]:
            with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
                sock.sendall(encode_request(offset, length))
                kind, n = RESPONSE.unpack(_exactly(sock, RESPONSE.size))
                assert (kind, _exactly(sock, n).decode()) == (b"ERR!", error)
                assert sock.recv(1) == b""  # closed after the error
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n")
            kind, n = RESPONSE.unpack(_exactly(sock, RESPONSE.size))
            assert kind == b"ERR!" and b"not a seeder request" in _exactly(sock, n)
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:  # still serving
            sock.sendall(encode_request(0, 4))
            assert _exactly(sock, RESPONSE.size + 4) == RESPONSE.pack(b"DATA", 4) + b"GGUF"


def test_manifest_must_be_the_owners(files, tmp_path):
    with pytest.raises(ManifestError, match="not the pinned"):
        load_manifest(files["manifest"], "0" * 64)
    data = json.loads(files["manifest"].read_text())
    data["tensors"][0]["units"][0][0][0] += 1  # a chunk that no longer covers its tensor
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="malformed: tensor 'token_embd.weight': unit 0's chunks do not cover it"):
        load_manifest(tmp_path / "bad.json")
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "fetch-slice", "127.0.0.1:9", "--manifest",
                           str(tmp_path / "bad.json"), "--experts", "0-3", "-o", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"moeswarm fetch-slice: error: manifest {tmp_path / 'bad.json'} is "
                                                f"malformed: tensor 'token_embd.weight': unit 0's chunks do not cover it"]


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        assert more, "connection closed early"
        data += more
    return data


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_pieces_come_from_any_seed_that_holds_them_and_a_lying_seed_is_passed_over(files, loop, tmp_path):
    """A first fetch keeps its pieces; a seed of them (slices/seed.py limited to those pieces) serves a
    second fetcher of fewer experts byte for byte, with the inviter's seeder gone. A seed that lies is
    passed over for the next source holding the piece; a seed asked for a piece it lacks refuses it."""
    from moeswarm.slices.kept import kept_pieces, pieces_paths
    from moeswarm.slices.sources import Source

    manifest = load_manifest(files["manifest"])
    first = tmp_path / "first.gguf"
    with seeding(loop, files["model"]) as (inviter, _):
        report = fetch_slice(inviter, manifest, EXPERTS, first, keep_pieces=True)
    assert _same(first, files["tmp"] / "expected.gguf") and report["from"] == {inviter: report["fetched_bytes"]}
    kept, listed = pieces_paths(first)
    held = {(p.offset, p.length) for p in manifest.pieces(EXPERTS, None, False)}
    assert kept_pieces(first, manifest) == held and not first.with_name("first.gguf.partial").exists()

    fewer = [3, 5]
    write_slice(files["model"], tmp_path / "expected-fewer.gguf", fewer)
    seed = Seeder(kept, pieces=frozenset(held))
    host, port = loop.call(seed.start("127.0.0.1", 0))
    try:
        gone = f"127.0.0.1:{_free_port()}"  # the inviter's seeder, stopped
        second = fetch_slice([Source(f"{host}:{port}", frozenset(held)), Source(gone)], manifest, fewer,
                             tmp_path / "second.gguf", retries=0)
        assert _same(tmp_path / "second.gguf", tmp_path / "expected-fewer.gguf")
        assert second["from"] == {f"{host}:{port}": second["fetched_bytes"]} and second["passed_over"] == []
        # a seed that is gone, asked first: the next source is asked at once (no back-off while another can serve)
        again = fetch_slice([Source(gone, frozenset(held)), Source(f"{host}:{port}", frozenset(held))], manifest,
                            fewer, tmp_path / "again.gguf")
        assert again["from"] == {f"{host}:{port}": again["fetched_bytes"]} and again["attempts"] == 2
        assert _same(tmp_path / "again.gguf", tmp_path / "expected-fewer.gguf")

        # a lying seed first: its lie is caught by the hash, and the honest seed gives the piece
        data = bytearray(kept.read_bytes())
        tensor = next(t for t in manifest.data["tensors"] if t["name"] == "blk.1.ffn_up_exps.weight")
        data[tensor["offset"] + 3 * (tensor["bytes"] // len(tensor["units"])) + 100] ^= 0x01  # expert 3
        liar_path = tmp_path / "liar.pieces"
        liar_path.write_bytes(bytes(data))
        with seeding(loop, liar_path) as (liar, _):
            third = fetch_slice([Source(liar, frozenset(held)), Source(f"{host}:{port}", frozenset(held))],
                                manifest, fewer, tmp_path / "third.gguf", retries=0)
            assert _same(tmp_path / "third.gguf", tmp_path / "expected-fewer.gguf")
            assert third["passed_over"] == [liar] and third["from"][liar] > 0  # the pieces before the lie count
            with pytest.raises(FetchError, match="does not match the owner's manifest"):  # the liar alone: no one left
                fetch_slice([Source(liar, frozenset(held))], manifest, fewer, tmp_path / "fourth.gguf", retries=0)
        with pytest.raises(FetchError, match=r"refused .*: bytes \[\d+, \d+\) are not a piece this seed holds"):
            fetch_slice(f"{host}:{port}", manifest, [7], tmp_path / "fifth.gguf", retries=0)  # expert 7: not held
        with pytest.raises(FetchError, match="no seed holds blk.0.ffn_.* expert 7"):
            fetch_slice([Source(f"{host}:{port}", frozenset(held))], manifest, [7], tmp_path / "sixth.gguf")
    finally:
        loop.call(seed.close())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_move_copies_the_pieces_it_kept_and_fetches_only_the_rest(files, loop, tmp_path):
    """A member moving from experts 2-5 to 4-7 (fetch_slice's `reuse`: node/rebalancing.py's move)
    copies the pieces the two shares share from its kept ones and fetches only experts 6 and 7's;
    a kept piece changed on disk is fetched again, never copied; the slice is byte for byte
    `moeswarm slice`'s."""
    from moeswarm.slices.kept import pieces_paths

    manifest = load_manifest(files["manifest"])
    moved = [4, 5, 6, 7]
    write_slice(files["model"], tmp_path / "expected-moved.gguf", moved)
    old = tmp_path / "old.gguf"

    def piece_bytes(experts):
        return {(p.offset, p.length) for p in manifest.pieces(experts, None, False)}

    common, new = piece_bytes(EXPERTS) & piece_bytes(moved), piece_bytes(moved) - piece_bytes(EXPERTS)
    expert_piece = next(p for p in manifest.pieces([4], None, False) if "expert 4" in p.label)
    with seeding(loop, files["model"]) as (address, _):
        fetch_slice(address, manifest, EXPERTS, old, keep_pieces=True)
        report = fetch_slice(address, manifest, moved, tmp_path / "moved.gguf", reuse=[old])
        assert _same(tmp_path / "moved.gguf", tmp_path / "expected-moved.gguf")
        assert report["reused_bytes"] == sum(n for _, n in common)
        assert report["fetched_bytes"] == sum(n for _, n in new) and report["fetched_bytes"] > 0

        kept = pieces_paths(old)[0]
        with kept.open("r+b") as handle:  # one byte of expert 4's first piece changed on disk
            handle.seek(expert_piece.offset)
            byte = handle.read(1)
            handle.seek(expert_piece.offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
        again = fetch_slice(address, manifest, moved, tmp_path / "again.gguf", reuse=[old, tmp_path / "absent.gguf"])
        assert _same(tmp_path / "again.gguf", tmp_path / "expected-moved.gguf")
        assert again["reused_bytes"] == report["reused_bytes"] - expert_piece.length
        assert again["fetched_bytes"] == report["fetched_bytes"] + expert_piece.length


def test_a_backbone_slice_holds_every_tensor_but_the_experts(files, tmp_path):
    """No experts with the backbone: every non-expert tensor byte for byte, no expert tensor, no
    expert keys (GGUF has no empty arrays), read back as a slice of no experts; without the
    backbone, no experts is refused in one line."""
    from moeswarm.errors import ModelError
    from moeswarm.gguf.gguf_file import GGUFFile
    from moeswarm.gguf.gguf_slice import expert_layer, write_slice

    report = write_slice(files["model"], tmp_path / "backbone.gguf", [], with_backbone=True)
    model, backbone = GGUFFile.open(files["model"]), GGUFFile.open(tmp_path / "backbone.gguf")
    trunk = [name for name in model.tensors if expert_layer(name) is None]
    assert list(backbone.tensors) == trunk and report["expert_tensors"] == 0 and report["layers"] == []
    assert all(bytes(backbone.tensors[n].data) == bytes(model.tensors[n].data) for n in trunk)
    assert backbone.is_slice and backbone.expert_ids == [] and backbone.sliced_layers == []
    assert backbone.fingerprint == model.fingerprint and model.expert_ids is None
    with pytest.raises(ModelError, match="and some unless with_backbone"):
        write_slice(files["model"], tmp_path / "none.gguf", [])
