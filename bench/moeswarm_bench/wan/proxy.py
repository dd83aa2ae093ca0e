"""WanProxy: a TCP proxy that behaves like a WAN link (see channel.py for the model).

    async with WanProxy(("127.0.0.1", 0), ("127.0.0.1", 9000), LinkProfile(rtt_s=0.08)) as proxy:
        host, port = proxy.address          # connect here instead of to the upstream
        proxy.set_profile(rtt_s=0.2)        # applies to chunks sent from now on
        proxy.stall(2.0); proxy.reset(); proxy.close_after(1000); proxy.clear()

One proxy is one link: every connection through it shares the link's bandwidth per direction.
"""

from __future__ import annotations

import asyncio
import random
import time

from moeswarm_bench.wan.channel import Channel
from moeswarm_bench.wan.clock import DEFAULT_SPIN_S
from moeswarm_bench.wan.connection import Connection
from moeswarm_bench.wan.faults import Faults
from moeswarm_bench.wan.link import LinkProfile


class WanProxy:
    """Listens on `listen`, forwards each connection to `upstream` through the emulated link.

    seed: seeds the jitter; None draws one from the clock.
    spin_s: busy-wait this long before each delivery for timing precision (see clock.py).
    """

    def __init__(
        self,
        listen: tuple[str, int],
        upstream: tuple[str, int],
        profile: LinkProfile,
        *,
        seed: int | None = None,
        spin_s: float = DEFAULT_SPIN_S,
    ):
        self.listen = listen
        self.upstream = upstream
        self.initial_profile = profile
        self.profile = profile
        self.faults = Faults()
        self.spin_s = spin_s
        self.seed = seed if seed is not None else time.time_ns() % 2**32
        rng = random.Random(self.seed)
        self.channel_up = Channel(lambda: self.profile, random.Random(rng.getrandbits(64)))
        self.channel_down = Channel(lambda: self.profile, random.Random(rng.getrandbits(64)))
        self.connections: dict[Connection, asyncio.Task] = {}
        self.accepted = 0
        self.upstream_failures = 0
        self._closed_bytes = [0, 0]  # up, down: bytes of connections already gone
        self._server: asyncio.Server | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> WanProxy:
        self._server = await asyncio.start_server(self._accept, *self.listen)
        return self

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) actually listened on (a port of 0 picks a free one)."""
        if self._server is None:
            raise RuntimeError("WanProxy.start() has not run")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.reset()
        tasks = list(self.connections.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> WanProxy:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        connection = Connection(self, reader, writer)
        self.connections[connection] = asyncio.current_task()
        try:
            await connection.run()
        except asyncio.CancelledError:
            # reset() and close() cancel this server-callback task; nobody awaits it, and on
            # Python 3.11 asyncio logs a cancelled callback task as an unhandled error.
            pass
        finally:
            del self.connections[connection]
            self._closed_bytes[0] += connection.bytes_up
            self._closed_bytes[1] += connection.bytes_down

    # -- run-time controls ---------------------------------------------------------------------

    def set_profile(self, **changes) -> LinkProfile:
        """Change rtt_s, jitter_s or bandwidth_bps; chunks already queued keep their times."""
        self.profile = self.profile.replace(**changes)
        return self.profile

    def reset(self) -> int:
        """Reset every open connection (both peers see ECONNRESET); returns how many."""
        for connection in list(self.connections):
            connection.reset()
        return len(self.connections)

    def stall(self, seconds: float) -> None:
        """Deliver nothing, either way, for `seconds` from now (data keeps queueing)."""
        self.faults.stall_until = asyncio.get_running_loop().time() + seconds

    def close_after(self, n_bytes: int | None) -> None:
        """Close each connection once it has forwarded `n_bytes` upstream (None: never)."""
        self.faults.close_after_bytes = n_bytes

    def clear(self) -> None:
        """Lift every fault and go back to the profile the proxy started with."""
        self.faults.clear()
        self.profile = self.initial_profile

    def status(self) -> dict:
        now = asyncio.get_running_loop().time()
        return {
            "listen": "%s:%d" % self.address,
            "upstream": "%s:%d" % self.upstream,
            "profile": self.profile.to_dict(),
            "faults": self.faults.to_dict(now),
            "seed": self.seed,
            "connections_open": len(self.connections),
            "connections_accepted": self.accepted,
            "upstream_failures": self.upstream_failures,
            "bytes_up": self._closed_bytes[0] + sum(c.bytes_up for c in self.connections),
            "bytes_down": self._closed_bytes[1] + sum(c.bytes_down for c in self.connections),
        }
