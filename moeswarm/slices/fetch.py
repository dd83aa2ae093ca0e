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
are removed (or, for a member that seeds them, kept: `keep_pieces`).

Pieces may come from several sources (slices/sources.py: the inviter's seeder and the seeds
joined members announce): each is asked for the missing pieces it holds, and one that fails,
refuses or lies is passed over for the next; the hash check is the same whoever sent the bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import ssl
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from moeswarm.errors import MoeSwarmError, printable
from moeswarm.ids import parse_address
from moeswarm.slices.manifest import Manifest, Piece
from moeswarm.slices.protocol import DATA, ERROR, MAX_ERROR, RESPONSE, encode_request
from moeswarm.slices.kept import copy_kept, pieces_paths, record_header, record_lines
from moeswarm.slices.sources import Source
from moeswarm.progress import progress
from moeswarm.gguf.gguf_slice import write_slice

WINDOW = 4  # requests in flight on the connection
TIMEOUT_S = 30.0
MIN_RATE = 64 << 10  # bytes/s: a piece must arrive within timeout_s + its length at this rate
log = logging.getLogger("moeswarm.fetch")


class FetchError(MoeSwarmError):
    """The fetch cannot go on: a lying or refusing seeder, or no connection after the retries."""


class Broken(Exception):
    """The connection broke: worth another try."""


def fetch_slice(peer: str | Sequence[Source], manifest: Manifest, experts: Sequence[int], out: str | Path,
                layers: tuple[int, int] | None = None, with_backbone: bool = False,
                tls: ssl.SSLContext | None = None, retries: int = 3, timeout_s: float = TIMEOUT_S,
                keep_pieces: bool = False, reuse: Sequence[str | Path] = ()) -> dict:
    """Fetch what a slice of `experts` needs and write it to `out`: from the seeder at `peer`
    (HOST:PORT), or from `peer`'s sources in turn (slices/sources.py), each asked for the missing
    pieces it holds; a source whose connection breaks is asked again (after the others, or after a
    back-off when it is the only one left) up to `retries` times; one that stays unreachable,
    refuses or lies (a piece whose hash is not the manifest's) is passed over, and FetchError (the
    last one's cause) comes when no source is left for a piece. keep_pieces: keep the checked pieces
    (`pieces_paths(out)`: a sparse file as long as the model, and the list of what it holds) for
    this member to seed. reuse: slices whose kept pieces are copied (checked) before any is fetched
    (slices/kept.py: a member moving to another share)."""
    out = Path(out)
    sources = [Source(peer)] if isinstance(peer, str) else list(peer)
    pieces = manifest.pieces(experts, layers, with_backbone)
    partial, record = out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.done")
    try:
        done = _resume(partial, record, manifest, pieces)
    except OSError as error:
        raise FetchError(f"cannot prepare {partial} ({manifest.file_size} bytes, sparse): "
                         f"{error.strerror or error}") from None
    resumed = sum(p.length for p in pieces if (p.offset, p.length) in done)
    total = sum(p.length for p in pieces)
    fetched, attempts, started = 0, Counter(), time.perf_counter()
    failed: dict[str, FetchError] = {}  # sources passed over, and why
    from_each: Counter[str] = Counter()  # bytes fetched from each source
    try:
        fd = os.open(partial, os.O_RDWR)
    except OSError as error:
        raise FetchError(f"cannot open {partial}: {error.strerror or error}") from None
    try:
        with record.open("a") as log_file, progress(desc=f"fetching {out.name}", total=total, unit="B") as bar:
            def keep(piece: Piece, data: bytes) -> None:  # a checked piece, into the partial file and its list
                _write(fd, partial, data, piece.offset)
                log_file.write(f"{piece.offset} {piece.length}\n")
                log_file.flush()
                done.add((piece.offset, piece.length))

            bar.update(resumed)
            reused = copy_kept(reuse, manifest, [p for p in pieces if (p.offset, p.length) not in done], keep)
            bar.update(reused)
            while todo := [p for p in pieces if (p.offset, p.length) not in done]:
                candidates = [s for s in sources if s.address not in failed
                              and any(s.holds((p.offset, p.length)) for p in todo)]
                # the least tried first (in the sources' order among equals): a seed that broke is tried
                # again only after the others
                source = min(candidates, key=lambda s: attempts[s.address], default=None)
                if source is None:
                    if failed:
                        raise list(failed.values())[-1]
                    raise FetchError(f"no seed holds {todo[0].label}; {len(done)} of {len(pieces)} pieces kept in "
                                     f"{partial}: run the same command again to resume")
                address = source.address
                try:
                    for piece, data in ranges(address, [p for p in todo if source.holds((p.offset, p.length))],
                                              tls, timeout_s):
                        _check(address, piece, data)
                        keep(piece, data)
                        fetched += piece.length
                        from_each[address] += piece.length
                        bar.update(piece.length)
                except Broken as error:
                    attempts[address] += 1
                    if attempts[address] > retries:
                        hint = "" if tls else " (if it was started with --swarm-key, pass the same --swarm-key)"
                        failed[address] = FetchError(
                            f"seeder {address}: {error}{hint}; {len(done)} of {len(pieces)} pieces kept in "
                            f"{partial}: run the same command again to resume")
                        _passed_over(address, failed[address], sources, failed)
                        continue
                    if len(candidates) == 1:  # no other source to ask meanwhile: back off before trying it again
                        time.sleep(min(0.5 * 2 ** (attempts[address] - 1), 5.0))
                except FetchError as error:  # it refused, or lied: nothing of the piece was kept
                    failed[address] = error
                    _passed_over(address, error, sources, failed)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    writing = out.with_name(out.name + ".writing")  # `out` appears whole or not at all: a slice there is one to reuse
    try:
        report = write_slice(partial, writing, experts, layers, with_backbone)
        os.replace(writing, out)
    except OSError as error:
        raise FetchError(f"cannot write {out}: {error.strerror or error} (the fetched pieces stay in {partial})") from None
    if report["fingerprint"] != manifest.fingerprint:
        raise FetchError(f"the slice's fingerprint {report['fingerprint']} is not the manifest's {manifest.fingerprint}")
    if keep_pieces:
        kept, listed = pieces_paths(out)
        os.replace(record, listed)
        os.replace(partial, kept)
    else:
        partial.unlink()
        record.unlink()
    return {**report, "peer": sources[0].address if len(sources) == 1 else [s.address for s in sources],
            "pieces": len(pieces), "fetched_bytes": fetched, "resumed_bytes": resumed, "reused_bytes": reused,
            "from": dict(from_each), "passed_over": sorted(failed),
            "fetch_s": round(seconds, 4), "attempts": sum(attempts.values()) + 1,
            "mb_per_s": round(fetched / seconds / 1e6, 2) if seconds > 0 else None}


def _passed_over(address: str, error: FetchError, sources: list[Source], failed: dict) -> None:
    if any(s.address not in failed for s in sources):
        log.warning("passing over seed %s: %s", address, printable(str(error), 300))


def _resume(partial: Path, record: Path, manifest: Manifest, pieces: list[Piece]) -> set[tuple[int, int]]:
    """The pieces already fetched and still good; starts fresh partial files when there are none usable."""
    header = record_header(manifest)
    if partial.is_file() and record.is_file() and partial.stat().st_size == manifest.file_size:
        lines = record.read_text(errors="replace").splitlines()
        if lines and lines[0] == header:
            wanted = {(p.offset, p.length): p for p in pieces}
            # lines as this file writes them; anything else (a torn or edited line) is ignored: its piece is fetched again
            listed = record_lines(lines[1:])
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
