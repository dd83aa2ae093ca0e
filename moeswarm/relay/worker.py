"""A worker's side of a relay: idle outbound connections, registered under the worker's name.

A worker behind NAT cannot be dialled, so it dials out: `RelayAttachment` keeps `pool`
connections open to the relay, each registered under the worker's name (wire/relay.py).
When a backbone takes one (the relay sends "P"), the connection is handed to the worker's server
as if it had been accepted: TLS server side with the swarm key, then the moeswarm protocol, end to
end with the backbone through the relay. A new idle connection replaces it at once.

At a keyed relay the registration proves the worker's member key (wire/relay.py): the
relay's challenge is signed with `identity` (transport/member_cert.py), whose certificate must name the
registered name.

A connection that fails (relay down, refused, silent past the keepalive) is opened again after a
backoff (0.5 s doubling to 30 s); the first failure of a run and each change of cause are logged.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from typing import TYPE_CHECKING

from moeswarm.deadline import within
from moeswarm.errors import printable
from moeswarm.wire.relay import (CHALLENGE, CHALLENGE_BYTES, ERROR, KEEPALIVE, OK, PAIRED, ROLE_WORKER,
                                         RelayError, challenge_bytes, encode_proof, encode_request, error_text,
                                         parse_error_length)

if TYPE_CHECKING:
    from moeswarm.transport.member_cert import Identity
    from moeswarm.worker.server import WorkerServer

log = logging.getLogger("moeswarm.worker")

CONNECT_TIMEOUT_S = 10.0
SILENCE_S = 60.0  # the relay sends a keepalive every 15 s by default: silence this long means it is gone
BACKOFF_S = (0.5, 30.0)


def relay_identity(key_file: str | None, name: str | None) -> tuple[str, Identity | None]:
    """(the name to register, the member key proving it) for `--swarm-key` and `--relay-name`: a
    member file registers its member's name by default; the swarm key itself may take any name;
    without a key, `name` or a random one, unproven."""
    if not key_file:
        return name or f"w-{secrets.token_hex(6)}", None
    from moeswarm.transport.member_cert import Identity

    identity = Identity.load(key_file, name=name or f"w-{secrets.token_hex(6)}")
    return name or identity.name, identity


class RelayAttachment:
    def __init__(self, server: WorkerServer, relay: tuple[str, int], name: str, pool: int = 2,
                 identity: Identity | None = None):
        self.server = server
        self.identity = identity  # the member key a keyed relay asks for
        self.relay = relay
        self.name = name
        self.pool = pool
        self.registered = 0  # idle connections registered now
        self.taken = 0  # connections handed to the server since start
        self._ready = asyncio.Event()  # set once a connection is registered
        self._sessions: set[asyncio.Task] = set()
        self._last_problem: str | None = None

    @property
    def route(self) -> str:
        return "relay://%s:%d/%s" % (*self.relay, self.name)

    async def run(self) -> None:
        """Keep `pool` idle connections registered, until cancelled."""
        slots = [asyncio.ensure_future(self._slot()) for _ in range(self.pool)]
        try:
            await asyncio.gather(*slots)
        finally:
            for task in [*slots, *self._sessions]:
                task.cancel()
            await asyncio.gather(*slots, *self._sessions, return_exceptions=True)

    async def wait_registered(self, timeout_s: float) -> None:
        """Return once a connection is registered; RelayError naming the last problem after `timeout_s`."""
        try:
            await within(timeout_s, self._ready.wait())
        except asyncio.TimeoutError:
            raise RelayError(f"cannot register at relay {self.relay[0]}:{self.relay[1]} within {timeout_s:g} s: "
                             f"{self._last_problem or 'no answer'}") from None

    async def _slot(self) -> None:
        backoff = BACKOFF_S[0]
        while True:
            sock = None
            try:
                sock = await self._register()
                self.registered += 1
                self._ready.set()
                backoff = BACKOFF_S[0]
                try:
                    await self._wait_paired(sock)
                finally:
                    self.registered -= 1
            except (OSError, RelayError, asyncio.TimeoutError, EOFError) as error:
                if sock is not None:
                    sock.close()
                self._problem(printable(str(error) or type(error).__name__))
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, BACKOFF_S[1])
                continue
            self.taken += 1
            task = asyncio.ensure_future(self._serve(sock))
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)

    async def _register(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.relay[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await within(CONNECT_TIMEOUT_S, loop.sock_connect(sock, self.relay))
            await loop.sock_sendall(sock, encode_request(ROLE_WORKER, self.name))
            status = await within(CONNECT_TIMEOUT_S, _read_exactly(sock, 1))
            if status == CHALLENGE:  # a keyed relay: prove the member key the name is bound to
                challenge = await within(CONNECT_TIMEOUT_S, _read_exactly(sock, CHALLENGE_BYTES))
                if self.identity is None:
                    raise RelayError("the relay registers members of a keyed swarm only: give --swarm-key")
                signature = self.identity.sign(challenge_bytes(challenge, self.name))
                await loop.sock_sendall(sock, encode_proof(self.identity.certificate_der, signature))
                status = await within(CONNECT_TIMEOUT_S, _read_exactly(sock, 1))
            if status == ERROR:
                raise RelayError(f"relay refused: {await _read_error(sock)}")
            if status != OK:
                raise RelayError(f"relay answered {status!r} to a registration, not {OK!r}")
        except BaseException:
            sock.close()
            raise
        if self._last_problem is not None:
            log.warning("registered at relay %s:%d as %s again", *self.relay, self.name)
            self._last_problem = None
        return sock

    async def _wait_paired(self, sock: socket.socket) -> None:
        """Read keepalives until "P": a backbone is spliced to this connection."""
        while True:
            status = await within(SILENCE_S, _read_exactly(sock, 1))
            if status == PAIRED:
                return
            if status == ERROR:
                raise RelayError(f"relay closed the connection: {await _read_error(sock)}")
            if status != KEEPALIVE:
                raise RelayError(f"relay sent {status!r} on an idle connection (expected keepalive or paired)")

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self.server.serve_socket(sock)
        except (OSError, asyncio.TimeoutError) as error:  # ssl.SSLError included: not the swarm key's peer
            log.warning("relayed connection to %s dropped before its session: %s", self.name,
                        printable(str(error) or type(error).__name__))
            sock.close()

    def _problem(self, cause: str) -> None:
        if cause != self._last_problem:
            log.warning("relay %s:%d: %s (retrying with backoff)", *self.relay, cause)
        self._last_problem = cause


async def _read_exactly(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes: never a byte of what follows (the pipe's first TLS record)."""
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise EOFError("relay closed the connection")
        data += chunk
    return data


async def _read_error(sock: socket.socket) -> str:
    length = parse_error_length(await within(CONNECT_TIMEOUT_S, _read_exactly(sock, 2)))
    return error_text(await within(CONNECT_TIMEOUT_S, _read_exactly(sock, length)))
