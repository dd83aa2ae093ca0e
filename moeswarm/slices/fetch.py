"""`moeswarm fetch-slice`: fetch only some experts' byte ranges from a seeder, check them, write a slice.

The pieces a slice needs (slices/manifest.py: the header, the fingerprint's samples, the experts'
blocks, and with --with-backbone every other tensor) are asked for on one connection, a few in
flight at once (slices/protocol.py), and each is checked against the owner's manifest on
arrival: a seeder that sends other bytes is caught at its first wrong piece, named in one line.

Checked pieces are written at their own offsets into OUT.partial, a sparse file as long as the
model (only the fetched bytes take disk space), and listed in OUT.partial.done. A broken
connection is retried; a fetch that stops (killed, or out of retries) resumes when run again: the
pieces listed are re-checked against the manifest and kept. Once every piece is there, the slice
is cut from the partial file by `moeswarm slice`'s own writer (gguf/gguf_slice.py), so the
result is byte for byte what `moeswarm slice` writes from the whole file, and the partial files
are removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import ssl
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from moeswarm.errors import MoeSwarmError, printable
from moeswarm.ids import parse_address
from moeswarm.slices.manifest import Manifest, Piece
from moeswarm.slices.protocol import DATA, ERROR, MAX_ERROR, RESPONSE, encode_request
from moeswarm.progress import progress
from moeswarm.gguf.gguf_slice import write_slice

RECORD_HEADER = "moeswarm-fetch/1"
WINDOW = 4  # requests in flight on the connection
TIMEOUT_S = 30.0
MIN_RATE = 64 << 10  # bytes/s: a piece must arrive within timeout_s + its length at this rate
_RECORD_LINE = re.compile(r"[0-9]{1,20} [0-9]{1,20}")


class FetchError(MoeSwarmError):
    """The fetch cannot go on: a lying or refusing seeder, or no connection after the retries."""


class Broken(Exception):
    """The connection broke: worth another try."""


def fetch_slice(peer: str, manifest: Manifest, experts: Sequence[int], out: str | Path,
                layers: tuple[int, int] | None = None, with_backbone: bool = False,
                tls: ssl.SSLContext | None = None, retries: int = 3, timeout_s: float = TIMEOUT_S) -> dict:
    """Fetch what a slice of `experts` needs from the seeder at `peer` (HOST:PORT) and write it to `out`."""
    out = Path(out)
    pieces = manifest.pieces(experts, layers, with_backbone)
    partial, record = out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.done")
    try:
        done = _resume(partial, record, manifest, pieces)
    except OSError as error:
        raise FetchError(f"cannot prepare {partial} ({manifest.file_size} bytes, sparse): "
                         f"{error.strerror or error}") from None
    resumed = sum(p.length for p in pieces if (p.offset, p.length) in done)
    total = sum(p.length for p in pieces)
    fetched, attempt, started = 0, 0, time.perf_counter()
    try:
        fd = os.open(partial, os.O_RDWR)
    except OSError as error:
        raise FetchError(f"cannot open {partial}: {error.strerror or error}") from None
    try:
        with record.open("a") as log, progress(desc=f"fetching {out.name}", total=total, unit="B") as bar:
            bar.update(resumed)
            while todo := [p for p in pieces if (p.offset, p.length) not in done]:
                try:
                    for piece, data in ranges(peer, todo, tls, timeout_s):
                        _check(peer, piece, data)
                        _write(fd, partial, data, piece.offset)
                        log.write(f"{piece.offset} {piece.length}\n")
                        log.flush()
                        done.add((piece.offset, piece.length))
                        fetched += piece.length
                        bar.update(piece.length)
                except Broken as error:
                    attempt += 1
                    if attempt > retries:
                        hint = "" if tls else " (if it was started with --swarm-key, pass the same --swarm-key)"
                        raise FetchError(f"seeder {peer}: {error}{hint}; {len(done)} of {len(pieces)} pieces kept in "
                                         f"{partial}: run the same command again to resume") from None
                    time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    try:
        report = write_slice(partial, out, experts, layers, with_backbone)
    except OSError as error:
        raise FetchError(f"cannot write {out}: {error.strerror or error} (the fetched pieces stay in {partial})") from None
    if report["fingerprint"] != manifest.fingerprint:
        raise FetchError(f"the slice's fingerprint {report['fingerprint']} is not the manifest's {manifest.fingerprint}")
    partial.unlink()
    record.unlink()
    return {**report, "peer": peer, "pieces": len(pieces), "fetched_bytes": fetched, "resumed_bytes": resumed,
            "fetch_s": round(seconds, 4), "attempts": attempt + 1,
            "mb_per_s": round(fetched / seconds / 1e6, 2) if seconds > 0 else None}


def _resume(partial: Path, record: Path, manifest: Manifest, pieces: list[Piece]) -> set[tuple[int, int]]:
    """The pieces already fetched and still good; starts fresh partial files when there are none usable."""
    header = f"{RECORD_HEADER} {manifest.sha256} {manifest.file_size}"
    if partial.is_file() and record.is_file() and partial.stat().st_size == manifest.file_size:
        lines = record.read_text(errors="replace").splitlines()
        if lines and lines[0] == header:
            wanted = {(p.offset, p.length): p for p in pieces}
            # lines as this file writes them; anything else (a torn or edited line) is ignored: its piece is fetched again
            listed = {tuple(int(x) for x in line.split()) for line in lines[1:] if _RECORD_LINE.fullmatch(line)}
            good = set()
            with partial.open("rb") as handle:
                for key in listed & set(wanted):
                    handle.seek(key[0])
                    if hashlib.sha256(handle.read(key[1])).hexdigest() == wanted[key].sha256:
                        good.add(key)
            record.write_text(header + "\n" + "".join(f"{o} {n}\n" for o, n in sorted(good)))
            return good
    with partial.open("wb") as handle:
        handle.truncate(manifest.file_size)  # sparse: holes take no disk space
    record.write_text(header + "\n")
    return set()


def _write(fd: int, partial: Path, data: bytes, offset: int) -> None:
    try:
        os.pwrite(fd, data, offset)
    except OSError as error:
        raise FetchError(f"cannot write {partial} at byte {offset}: {error.strerror or error}") from None


def _check(peer: str, piece: Piece, data: bytes) -> None:
    if hashlib.sha256(data).hexdigest() != piece.sha256:
        what = "another file" if piece.label.startswith("header") else "other bytes"
        raise FetchError(f"seeder {peer} sent {piece.label} (bytes {piece.offset}-{piece.offset + piece.length}) "
                         f"whose sha256 does not match the owner's manifest: it serves {what}, or lies; nothing of "
                         f"it was kept")


def ranges(peer: str, pieces: list[Piece], tls: ssl.SSLContext | None, timeout_s: float) -> Iterator[tuple[Piece, bytes]]:
    """Each piece's bytes as the seeder sends them, in order, WINDOW requests in flight."""
    sock = _connect(peer, tls, timeout_s)
    try:
        ahead = 0
        for number, piece in enumerate(pieces):
            while ahead < len(pieces) and ahead < number + WINDOW:
                _send(sock, encode_request(pieces[ahead].offset, pieces[ahead].length))
                ahead += 1
            yield piece, _response(sock, peer, piece, timeout_s)
    finally:
        sock.close()


def _connect(peer: str, tls: ssl.SSLContext | None, timeout_s: float) -> socket.socket:
    host, port = parse_address(peer)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as error:
        raise Broken(f"cannot connect ({error.strerror or error})") from None
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock)
    except ssl.SSLError as error:
        sock.close()
        raise FetchError(f"seeder {peer}: TLS handshake failed ({error.reason or error}): the seeder must use the "
                         f"same --swarm-key") from None
    except OSError as error:
        sock.close()
        raise Broken(f"TLS handshake broke ({error})") from None


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as error:
        raise Broken(f"connection lost ({error})") from None


def _response(sock: socket.socket, peer: str, piece: Piece, timeout_s: float) -> bytes:
    """The piece's bytes, all within its deadline: a seeder that trickles them is cut off (Broken)."""
    allowed = timeout_s + piece.length / MIN_RATE
    deadline = time.monotonic() + allowed
    what = f"{piece.label} (bytes {piece.offset}-{piece.offset + piece.length})"
    kind, length = RESPONSE.unpack(_exactly(sock, RESPONSE.size, deadline, what, allowed))
    if kind == ERROR:
        message = _exactly(sock, min(length, MAX_ERROR), deadline, what, allowed).decode(errors="replace")
        raise FetchError(f"seeder {peer} refused {piece.label}: {printable(message)}")
    if kind != DATA:
        raise FetchError(f"seeder {peer} answered with {printable(repr(kind))}: not a moeswarm seeder")
    if length != piece.length:
        raise FetchError(f"seeder {peer} sent {length} bytes for {piece.label}, which has {piece.length}")
    return _exactly(sock, length, deadline, what, allowed)


def _exactly(sock: socket.socket, size: int, deadline: float, what: str, allowed: float) -> bytes:
    buffer, got = bytearray(size), 0
    view = memoryview(buffer)
    try:
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Broken(f"{what} not received within {allowed:.3g} s ({got} of {size} bytes): the seeder is "
                              f"too slow or stalls")
            sock.settimeout(left)
            n = sock.recv_into(view[got:])
            if n == 0:
                raise Broken("the seeder closed the connection")
            got += n
    except TimeoutError:
        raise Broken(f"{what} not received within {allowed:.3g} s ({got} of {size} bytes): the seeder is too slow "
                      f"or stalls") from None
    except ssl.SSLError as error:
        raise Broken(f"TLS error ({error.reason or error})") from None
    except OSError as error:
        raise Broken(f"connection lost ({error})") from None
    return bytes(buffer)
