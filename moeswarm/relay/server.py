"""The relay: splices a backbone's connection to a worker's outbound one, for workers behind NAT.

A worker that cannot be dialled keeps idle connections open to the relay, registered under its
name (relay/worker.py). A backbone connects to the relay and names the worker; the relay takes
one of that worker's idle connections, tells the worker ("P") and from then on copies bytes both
ways without reading them. TLS with the swarm key runs end to end through the pipe
(transport/relay.py), so the relay sees only ciphertext, its sizes and its timing; a byte it
alters breaks the TLS record and the connection, never a result.

Everything a peer can make the relay hold is bounded (RelayLimits): open connections, names,
names per host, idle connections and pipes per name, the time a handshake may take, the time a
backbone waits for an idle connection, and the time a pipe may carry nothing. The relay never
learns the swarm key.

Names are bound. A keyed relay (`authority`: the swarm's certificate, transport/member_cert.py)
registers a name only for the member whose certificate names it, proven by a signed challenge
(wire/relay.py): a peer without that member's key cannot register it at all. A name in
use (idle connections or pipes) is bound to its owner (the member; unkeyed, the peer's host), so
nobody else can add connections under it while it is held; the owner's newest registration
replaces its oldest idle one when the name is full (a restarted worker is not locked out by its
own stale connections). An unkeyed relay can only bind names to hosts: the first host to register
a name holds it while it is in use, which is why `moeswarm relay` warns without a key.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from moeswarm.deadline import within
from moeswarm.errors import printable
from moeswarm.transport.member_cert import Authority, CertError
from moeswarm.wire.relay import (CHALLENGE, CHALLENGE_BYTES, KEEPALIVE, OK, PAIRED, REQUEST_HEAD, ROLE_WORKER,
                                         SIGNATURE_BYTES, RelayError, challenge_bytes, encode_error, parse_name,
                                         parse_proof_length, parse_request_head)

log = logging.getLogger("moeswarm.relay")

CHUNK = 1 << 16


@dataclass(frozen=True)
class RelayLimits:
    max_connections: int = 1024  # open TCP connections, idle, spliced or in their handshake
    max_names: int = 256  # distinct worker names with idle connections
    max_idle_per_name: int = 8  # idle connections one name may keep registered
    max_pipes_per_name: int = 64  # spliced pipes to one name at once
    max_names_per_host: int = 16  # names registered from one host (IP address) at once
    handshake_timeout_s: float = 10.0  # from accept to a whole request
    wait_for_worker_s: float = 5.0  # a backbone waits this long for the named worker's idle connection
    keepalive_s: float = 15.0  # a byte to each idle worker connection this often (NAT mappings stay open)
    idle_timeout_s: float = 600.0  # a spliced pipe carrying nothing either way for this long is closed


@dataclass
class _Idle:
    """A worker's registered connection, waiting for a backbone."""

    name: str
    owner: str  # "member ID" (keyed) or "host H" (unkeyed): who the name is bound to
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    taken: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    released: asyncio.Event = field(default_factory=asyncio.Event)  # its idle watch no longer reads the stream


@dataclass
class RelayStats:
    connections: int = 0  # open now
    pipes: int = 0  # spliced now
    spliced: int = 0  # since start
    refused: int = 0  # handshakes answered with an error, or connections over the limit
    bytes_relayed: int = 0


class RelayServer:
    def __init__(self, limits: RelayLimits | None = None, authority: Authority | None = None):
        """authority: the swarm's certificate; registering a name then takes that member's key."""
        self.limits = limits or RelayLimits()
        self.authority = authority
        self.stats = RelayStats()
        self._idle: dict[str, collections.deque[_Idle]] = {}
        self._bound: dict[str, tuple[str, str]] = {}  # name in use -> (owner, host it registered from)
        self._host_names: dict[str, set[str]] = {}  # host -> names in use it registered
        self._pipes: collections.Counter[str] = collections.Counter()  # name -> spliced pipes now
        self._registered = asyncio.Condition()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._accept, host, port, backlog=min(self.limits.max_connections, 4096))
        return self._server.sockets[0].getsockname()[:2]

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() first"
        try:
            await self._server.serve_forever()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for task in self._tasks if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for queue in self._idle.values():
            for idle in queue:
                idle.writer.transport.abort()
        self._idle.clear()

    def idle_counts(self) -> dict[str, int]:
        """Idle connections registered per worker name."""
        return {name: len(queue) for name, queue in self._idle.items()}

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.stats.connections += 1
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peername = writer.get_extra_info("peername")
        peer = printable(str(peername))
        host = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        keep_open = False
        try:
            if self.stats.connections > self.limits.max_connections:
                raise RelayError(f"relay busy: {self.limits.max_connections} connections open; retry later")
            deadline = time.monotonic() + self.limits.handshake_timeout_s
            role, name = await within(self.limits.handshake_timeout_s, self._read_request(reader))
            if role == ROLE_WORKER:
                owner = await within(max(deadline - time.monotonic(), 0), self._prove(name, host, reader, writer))
                keep_open = await self._register(name, owner, host, reader, writer)
            else:
                await self._connect(name, reader, writer)
        except asyncio.TimeoutError:
            self.stats.refused += 1
            log.info("%s: no whole relay request within %g s: closed", peer, self.limits.handshake_timeout_s)
            writer.write(encode_error(f"no relay request within {self.limits.handshake_timeout_s:g} s"))
        except RelayError as error:
            self.stats.refused += 1
            log.info("%s: refused: %s", peer, printable(str(error)))
            writer.write(encode_error(str(error)))
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            log.info("%s: connection ended: %s", peer, printable(str(error) or type(error).__name__))
        except asyncio.CancelledError:
            pass  # the relay is closing
        finally:
            self._tasks.discard(task)
            if not keep_open:  # a spliced worker connection is counted until its pipe ends
                self.stats.connections -= 1
                writer.close()  # after the error reply, if any, is flushed

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[bytes, str]:
        role, length = parse_request_head(await reader.readexactly(REQUEST_HEAD))
        return role, parse_name(await reader.readexactly(length))

    async def _prove(self, name: str, host: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """Who registers `name`: the member whose key answers the challenge (keyed), else the peer's host."""
        if self.authority is None:
            return f"host {host}"
        challenge = os.urandom(CHALLENGE_BYTES)
        writer.write(CHALLENGE + challenge)
        certificate = await reader.readexactly(parse_proof_length(await reader.readexactly(2)))
        signature = await reader.readexactly(SIGNATURE_BYTES)
        try:
            member = self.authority.check(certificate)
        except CertError as error:
            raise RelayError(f"cannot register {name}: {error}") from None
        if member.name != name:
            raise RelayError(f"cannot register {name}: the member certificate names {printable(member.name)!r} "
                             "(a member registers its own name only)")
        if not member.verify(signature, challenge_bytes(challenge, name)):
            raise RelayError(f"cannot register {name}: the signature does not match the member certificate")
        return f"member {member.member_id}"

    async def _register(self, name: str, owner: str, host: str, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> bool:
        """Hold a worker's idle connection until a backbone takes it (True: the pipe owns it now)."""
        bound = self._bound.get(name)
        if bound is not None and bound[0] != owner:
            raise RelayError(f"name {name} is in use by another {bound[0].split()[0]}: a registered worker is not displaced")
        if bound is None:
            if len(self._bound) >= self.limits.max_names:
                raise RelayError(f"relay full: {self.limits.max_names} worker names registered")
            if len(self._host_names.get(host, ())) >= self.limits.max_names_per_host:
                raise RelayError(f"host {host} already registered {self.limits.max_names_per_host} names here")
            self._bound[name] = (owner, host)
            self._host_names.setdefault(host, set()).add(name)
        queue = self._idle.setdefault(name, collections.deque())
        if len(queue) >= self.limits.max_idle_per_name:  # the owner's own stale ones: the oldest gives way
            oldest = queue.popleft()
            log.info("worker %s: a new registration replaces the oldest of %d idle connections", name, len(queue) + 1)
            oldest.writer.transport.abort()
        idle = _Idle(name, owner, reader, writer)
        queue.append(idle)
        writer.write(OK)
        async with self._registered:
            self._registered.notify_all()
        watch = asyncio.ensure_future(reader.read(1))  # a worker sends nothing while idle: EOF or a byte ends it
        try:
            while True:
                await asyncio.wait({idle.taken, watch}, timeout=self.limits.keepalive_s, return_when=asyncio.FIRST_COMPLETED)
                if idle.taken.done():
                    return True  # a backbone's task splices it now
                if watch.done():
                    log.info("worker %s: idle connection closed", name)
                    return False
                writer.write(KEEPALIVE)
                await within(self.limits.keepalive_s, writer.drain())
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)  # a StreamReader serves one reader at a time
            idle.released.set()
            if not idle.taken.done():
                self._forget(idle)

    def _forget(self, idle: _Idle) -> None:
        queue = self._idle.get(idle.name)
        if queue is not None and idle in queue:
            queue.remove(idle)
            if not queue:
                del self._idle[idle.name]
        self._unbind(idle.name)

    def _unbind(self, name: str) -> None:
        """Free `name` for anyone once it has neither idle connections nor pipes."""
        if self._idle.get(name) or self._pipes[name] or name not in self._bound:
            return
        _, host = self._bound.pop(name)
        self._pipes.pop(name, None)
        names = self._host_names.get(host)
        if names is not None:
            names.discard(name)
            if not names:
                del self._host_names[host]

    async def _take(self, name: str) -> _Idle:
        """The newest idle connection of `name` (the likeliest alive), waiting for one a short while."""
        def available() -> bool:
            return bool(self._idle.get(name))

        async with self._registered:
            try:
                await within(self.limits.wait_for_worker_s, self._registered.wait_for(available))
            except asyncio.TimeoutError:
                raise RelayError(f"no worker named {name} is registered at this relay") from None
        idle = self._idle[name].pop()
        if not self._idle[name]:
            del self._idle[name]
        idle.taken.set_result(None)
        return idle

    async def _connect(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pipes[name] >= self.limits.max_pipes_per_name:
            raise RelayError(f"worker {name} already has {self.limits.max_pipes_per_name} pipes through this relay; "
                             "retry later")
        worker = await self._take(name)
        self._pipes[name] += 1
        worker.writer.write(PAIRED)  # before any byte of the backbone's: the worker starts TLS after it
        writer.write(OK)
        self.stats.pipes += 1
        self.stats.spliced += 1
        log.info("worker %s: spliced to backbone %s", name, printable(str(writer.get_extra_info("peername"))))
        try:
            await worker.released.wait()
            await self._splice(reader, writer, worker.reader, worker.writer)
        finally:
            self.stats.pipes -= 1
            self._pipes[name] -= 1
            self._unbind(name)
            self.stats.connections -= 1  # the worker's connection, kept open by its own task's end
            worker.writer.transport.abort()

    async def _splice(self, a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter,
                      b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter) -> None:
        """Copy both ways (a: the backbone's connection, b: the worker's) until either side ends, or
        nothing moves for idle_timeout_s."""
        moved = [time.monotonic()]
        pumps = {asyncio.ensure_future(self._pump(a_reader, b_writer, moved)),
                 asyncio.ensure_future(self._pump(b_reader, a_writer, moved))}
        idle_s = self.limits.idle_timeout_s
        try:
            while True:
                left = moved[0] + idle_s - time.monotonic()
                if left <= 0:
                    log.info("pipe idle for %g s: closed", idle_s)
                    return
                done, _ = await asyncio.wait(pumps, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if done:
                    return
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, moved: list[float]) -> None:
        """One direction of a pipe (no timeout per read: the splice's watch closes an idle pipe)."""
        while data := await reader.read(CHUNK):
            writer.write(data)
            self.stats.bytes_relayed += len(data)
            moved[0] = time.monotonic()
            await writer.drain()
