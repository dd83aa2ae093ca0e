"""One client connection through the proxy: its upstream connection and the two pumps."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Protocol

from moeswarm_bench.wan.channel import Channel
from moeswarm_bench.wan.faults import Faults
from moeswarm_bench.wan.pump import BudgetSpent, Pump


class ProxySide(Protocol):
    """What a connection uses of its proxy (wan/proxy.py's WanProxy)."""

    upstream: tuple[str, int]
    upstream_failures: int
    channel_up: Channel
    channel_down: Channel
    faults: Faults
    spin_s: float


def set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def abort_with_reset(writer: asyncio.StreamWriter | None) -> None:
    """Close so that the peer sees ECONNRESET: SO_LINGER on with a zero timeout sends an RST."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Connection:
    """Client <-> proxy <-> upstream. Ends gracefully when both directions have ended, with a
    reset of both sides when either side resets, and by `reset()` on demand."""

    def __init__(self, proxy: ProxySide, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._proxy = proxy
        self._client_reader = reader
        self._client_writer = writer
        self._upstream_writer: asyncio.StreamWriter | None = None
        self.up: Pump | None = None  # client -> upstream
        self.down: Pump | None = None  # upstream -> client
        self._task: asyncio.Task | None = None

    @property
    def bytes_up(self) -> int:
        return self.up.forwarded if self.up else 0

    @property
    def bytes_down(self) -> int:
        return self.down.forwarded if self.down else 0

    async def run(self) -> None:
        proxy = self._proxy
        self._task = asyncio.current_task()
        set_nodelay(self._client_writer)
        try:
            upstream_reader, self._upstream_writer = await asyncio.open_connection(*proxy.upstream)
        except OSError:
            proxy.upstream_failures += 1
            abort_with_reset(self._client_writer)
            return
        set_nodelay(self._upstream_writer)
        self.up = Pump(
            self._client_reader,
            self._upstream_writer,
            proxy.channel_up,
            proxy.faults,
            spin_s=proxy.spin_s,
            allowance=self._allowance,
        )
        self.down = Pump(
            upstream_reader, self._client_writer, proxy.channel_down, proxy.faults, spin_s=proxy.spin_s
        )
        pumps = [asyncio.ensure_future(self.up.run()), asyncio.ensure_future(self.down.run())]
        try:
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # re-raise the first failure
            await self._close_gracefully()
        except BudgetSpent:
            await self._close_gracefully()
        except (ConnectionError, OSError):
            self._abort()
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _allowance(self, forwarded: int) -> int | None:
        limit = self._proxy.faults.close_after_bytes
        return None if limit is None else limit - forwarded

    async def _close_gracefully(self) -> None:
        for writer in (self._upstream_writer, self._client_writer):
            if writer is not None:
                writer.close()
        for writer in (self._upstream_writer, self._client_writer):
            if writer is not None:
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    def reset(self) -> None:
        """Reset both sides now (the peers see ECONNRESET) and stop forwarding."""
        self._abort()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    def _abort(self) -> None:
        abort_with_reset(self._client_writer)
        abort_with_reset(self._upstream_writer)
