"""The seeder: serves byte ranges of one model file to joining workers (`moeswarm seed`).

A worker that is to host some experts fetches just their byte ranges (slices/fetch.py) from a
peer that has the file, or from a joined member that holds those pieces (`pieces`: it serves
only them). The seeder trusts nobody and is trusted by nobody: with a swarm key it
talks only to peers holding the same key (mutual TLS, transport/tls.py); what it sends is checked
against the owner's manifest by the fetcher. Every request is bounded (slices/protocol.py): at
most MAX_REQUEST bytes, inside the file; a bad one gets a one-line ERR! and the connection closes,
the seeder goes on serving. A connection reads one request at a time, so it holds at most one
range in memory; one that sends nothing, or takes nothing, for IDLE_TIMEOUT_S is closed. File
reads run off the event loop.

Slots are budgeted as the worker's are (worker/admission.py): a TLS handshake in progress holds
one and must finish within HANDSHAKE_TIMEOUT_S, each peer address has its own cap, and once the
seeder is full a connection with no request in flight for EVICT_AFTER_S gives its slot to the
newcomer: silent peers cannot hold the slots. Accept and handshake failures are logged once per
cause with a count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

import functools
import time

from moeswarm.deadline import within
from moeswarm.errors import MoeSwarmError, ProtocolError, printable
from moeswarm.slices.protocol import DATA, MAX_REQUEST, REQUEST, RESPONSE, decode_request, encode_error
from moeswarm.worker.admission import ConnectionTable, CountedLog, StreamProtocol, handshake, loop_errors, peer_host

log = logging.getLogger("moeswarm.seed")
MAX_CONNECTIONS = 64
MAX_PER_PEER = 16
IDLE_TIMEOUT_S = 60.0
HANDSHAKE_TIMEOUT_S = 10.0
EVICT_AFTER_S = 5.0
LINGER_S = 2.0  # after an ERR!, how long the fetcher's unread requests are read and dropped


class Seeder:
    """Serve the file at `path`. tls: the swarm key's server context, or None for plain TCP."""

    def __init__(self, path: str | Path, tls: ssl.SSLContext | None = None, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_per_peer: int = MAX_PER_PEER,
                 evict_after_s: float = EVICT_AFTER_S, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 pieces: frozenset[tuple[int, int]] | None = None):
        """pieces: the (offset, length) ranges this seeder holds and serves, each asked for whole (a
        joined member's seed: the pieces it fetched, at their offsets in a sparse file as long as the
        model); None: any range of the file (the inviter's whole model)."""
        self.pieces = pieces
        self.path = Path(path)
        if not self.path.is_file():
            raise MoeSwarmError(f"{self.path}: no such file to seed")
        self.size = self.path.stat().st_size
        self.tls = tls
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.sent_bytes = 0
        self._fd = os.open(self.path, os.O_RDONLY)
        self._server: asyncio.base_events.Server | None = None
        self.handshake_timeout_s = handshake_timeout_s
        self._writers: set[asyncio.StreamWriter] = set()
        self.table = ConnectionTable(max_connections, max_per_peer, evict_after_s)
        self.refusals = CountedLog(log, "connections refused")
        self.failures = CountedLog(log, "connections failed before their first request")

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(functools.partial(loop_errors, self.failures, loop.get_exception_handler()))
        paused = self.tls is not None

        def protocol() -> asyncio.StreamReaderProtocol:
            return StreamProtocol(asyncio.StreamReader(limit=2**16, loop=loop), self._serve, loop=loop, paused=paused)

        self._server = await loop.create_server(protocol, host, port)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        """Stop listening and drop every connection (a fetcher resumes elsewhere); again: nothing."""
        if self._fd < 0:
            return
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        os.close(self._fd)
        self._fd = -1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = printable(str(writer.get_extra_info("peername")))
        slot = self.table.admit(peer_host(writer))
        if isinstance(slot, str):
            self.refusals.note("over the per-address limit" if "your address" in slot else "over the connection limit")
            if self.tls is None:
                writer.write(encode_error(f"seeder busy: {slot}"))
                writer.close()
            else:
                writer.transport.abort()
            return
        serving = False
        slot.busy = lambda: serving
        slot.evict = lambda _message: writer.transport.abort()
        self._writers.add(writer)
        try:
            if self.tls is not None and not await handshake(writer, self.tls, self.handshake_timeout_s, self.failures):
                return
            slot.greeted = True
            while True:
                try:
                    raw = await within(self.idle_timeout_s, reader.readexactly(REQUEST.size))
                except asyncio.IncompleteReadError:
                    return  # the fetcher is done
                serving, slot.last_active = True, time.monotonic()
                try:
                    offset, length = self._check(*decode_request(raw))
                except ProtocolError as error:
                    log.info("refused a request from %s: %s", peer, error)
                    writer.write(encode_error(str(error)))
                    await writer.drain()
                    await _linger(reader)
                    return
                data = await asyncio.to_thread(os.pread, self._fd, length, offset)
                writer.write(RESPONSE.pack(DATA, len(data)))
                writer.write(data)
                del data
                await within(self.idle_timeout_s, writer.drain())  # a peer that stops reading is dropped
                self.sent_bytes += length
                serving, slot.last_active = False, time.monotonic()
        except (asyncio.TimeoutError, ConnectionError, OSError, ssl.SSLError) as error:
            log.info("connection from %s ended: %s", peer, printable(str(error) or type(error).__name__))
        finally:
            self.table.release(slot)
            self._writers.discard(writer)
            writer.close()

    def _check(self, offset: int, length: int) -> tuple[int, int]:
        if not 0 < length <= MAX_REQUEST:
            raise ProtocolError(f"a request may ask for 1 to {MAX_REQUEST} bytes, not {length}")
        if offset + length > self.size:
            raise ProtocolError(f"bytes [{offset}, {offset + length}) lie beyond the file's {self.size} bytes")
        if self.pieces is not None and (offset, length) not in self.pieces:
            raise ProtocolError(f"bytes [{offset}, {offset + length}) are not a piece this seed holds")
        return offset, length


async def _linger(reader: asyncio.StreamReader, seconds: float = LINGER_S) -> None:
    """Read and drop what the fetcher sent after a refused request (its pipelined requests) until it
    closes, for at most `seconds`: closing with unread bytes resets the connection, and the fetcher
    would see the reset instead of the ERR! that says why."""
    try:
        await within(seconds, _drain_input(reader))
    except (asyncio.TimeoutError, ConnectionError, OSError, ssl.SSLError):
        pass


async def _drain_input(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass
