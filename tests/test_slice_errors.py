"""Hostile manifests, records and seeders: every fetch-slice and manifest error is one line, a piece
has an overall deadline, and silent peers cannot hold a seeder's slots.

Uses test_fetch_slice's files and seeders (a random GGUF, its manifest, seeders on a background loop).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from moeswarm.slices.manifest import MAX_FILE_SIZE, ManifestError, load_manifest
from moeswarm.slices.seed import Seeder
from moeswarm.slices.fetch import FetchError, fetch_slice
from moeswarm.slices.kept import RECORD_HEADER
from moeswarm.slices.protocol import REQUEST, RESPONSE, decode_request
from test_fetch_slice import EXPERTS, WAIT_S, _same, files, loop, seeding  # noqa: F401  (fixtures)


def _fetch_cli(manifest, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", "fetch-slice", "127.0.0.1:9", "--manifest",
                           str(manifest), "--experts", "0-3", "-o", str(out)], capture_output=True, text=True,
                          timeout=120)


def test_hostile_manifests_are_refused_in_one_line(files, tmp_path):
    huge = json.loads(files["manifest"].read_text())
    huge["file_size"] = 2**62
    (tmp_path / "huge.json").write_text(json.dumps(huge))
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{}")
    cases = {
        "huge.json": f"malformed: file_size {2**62} is over the {MAX_FILE_SIZE} bytes (16 TiB) a model file may have",
        "deep.json": "is not a manifest: its JSON is nested too deeply",
        "binary.json": "is not JSON (",
    }
    for name, message in cases.items():
        with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_manifest(tmp_path / name)
    done = [_fetch_cli(tmp_path / name, tmp_path / "x.gguf") for name in cases]
    for name, run in zip(cases, done):
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert lines[0].startswith(f"moeswarm fetch-slice: error: manifest {tmp_path / name} ") and \
            cases[name] in lines[0], lines[0]


def test_a_malformed_record_line_is_ignored_and_the_fetch_resumes(files, loop, tmp_path):
    manifest = load_manifest(files["manifest"])
    out = tmp_path / "part.gguf"
    partial, record = tmp_path / "part.gguf.partial", tmp_path / "part.gguf.partial.done"
    first = manifest.pieces(EXPERTS, None, False)[0]
    with partial.open("wb") as handle:  # a partial file holding the first piece, as a stopped fetch leaves it
        handle.truncate(manifest.file_size)
        handle.seek(first.offset)
        handle.write(files["model"].read_bytes()[first.offset:first.offset + first.length])
    record.write_bytes((f"{RECORD_HEADER} {manifest.sha256} {manifest.file_size}\n{first.offset} {first.length}\n"
                        "\uff11\uff12 4\n\u00b2 5\n7 x\n1 2 3\n" + "9" * 5000 + " 1\n").encode() + b"\xff\xfe 3\n")
    with seeding(loop, files["model"]) as (address, _):
        report = fetch_slice(address, manifest, EXPERTS, out)
    assert report["resumed_bytes"] == first.length
    assert _same(out, files["tmp"] / "expected.gguf")


def test_fetch_errors_on_the_local_side_are_one_line(files, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "fetch-slice", "127.0.0.1:9", "--manifest",
                           str(files["manifest"]), "--experts", "0-3", "-o", str(blocker / "x.gguf")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


class _TricklingSeeder:
    """Answers every request with a DATA header, then one byte every `every_s`: never a whole piece."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(sock,), daemon=True).start()

    def _trickle(self, sock: socket.socket) -> None:
        with sock:
            try:
                raw = b""
                while len(raw) < REQUEST.size:
                    raw += sock.recv(REQUEST.size - len(raw))
                _, length = decode_request(raw)
                sock.sendall(RESPONSE.pack(b"DATA", length))
                while not self.stop.wait(self.every_s):
                    sock.sendall(b"\0")
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_trickling_seeder_cannot_stall_a_fetch(files, tmp_path):
    manifest = load_manifest(files["manifest"])
    seeder = _TricklingSeeder(every_s=0.1)  # each byte well within the socket timeout: only a deadline stops it
    try:
        started = time.monotonic()
        with pytest.raises(FetchError) as caught:
            fetch_slice(seeder.address, manifest, EXPERTS, tmp_path / "part.gguf", retries=1, timeout_s=0.5)
        elapsed = time.monotonic() - started
    finally:
        seeder.close()
    first = manifest.pieces(EXPERTS, None, False)[0]
    allowed = 0.5 + first.length / (64 << 10)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{first.label} (bytes {first.offset}-{first.offset + first.length}) not received within {allowed:.3g} s" \
        in message and "the seeder is too slow or stalls" in message and "run the same command again" in message
    assert seeder.connections == 2  # one retry
    assert elapsed < 2 * allowed + 0.5 + 2.0


def test_silent_peers_cannot_hold_a_seeders_slots(files, loop, tmp_path):
    manifest = load_manifest(files["manifest"])
    seeder = Seeder(files["model"], max_connections=2, evict_after_s=0.3)
    host, port = loop.call(seeder.start("127.0.0.1", 0))
    try:
        silent = [socket.create_connection((host, port), timeout=WAIT_S) for _ in range(2)]
        time.sleep(0.4)
        report = fetch_slice(f"{host}:{port}", manifest, EXPERTS, tmp_path / "part.gguf", retries=0)
        assert report["pieces"] > 0 and _same(tmp_path / "part.gguf", files["tmp"] / "expected.gguf")
        assert seeder.table.evicted >= 1
        assert silent[0].recv(1) == b""  # the quietest was closed to make room
    finally:
        loop.call(seeder.close())
    crowded = Seeder(files["model"], max_per_peer=1, evict_after_s=60)
    host, port = loop.call(crowded.start("127.0.0.1", 0))
    try:
        first = socket.create_connection((host, port), timeout=WAIT_S)
        second = socket.create_connection((host, port), timeout=WAIT_S)
        kind, n = RESPONSE.unpack(second.recv(RESPONSE.size, socket.MSG_WAITALL))
        assert (kind, second.recv(n, socket.MSG_WAITALL).decode()) == (
            b"ERR!", "seeder busy: 1 connections from your address open (limit 1 per address); retry later")
        first.close()
    finally:
        loop.call(crowded.close())
