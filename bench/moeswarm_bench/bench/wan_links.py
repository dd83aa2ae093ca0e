"""Emulated WAN links in front of worker processes, for benchmarks.

    with wan_links(worker_addresses, LinkProfile(rtt_s=0.1)) as links:
        swarm = open_swarm(model, links.addresses)      # every byte crosses a WanProxy
        links.set_profile(0, rtt_s=0.02)                   # one link
        links.set_all(rtt_s=0.08, bandwidth_bps=100e6)     # every link

One WanProxy per worker: each link has its own bandwidth cap per direction. The proxies run in
one asyncio loop on a background thread of this process, so the backbone's blocking sockets and
the proxies share the GIL; the switch interval is lowered while the links are up so that a proxy
due to deliver is not held back by the backbone's Python for the default 5 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Iterator

from moeswarm.ids import parse_address
from moeswarm_bench.wan import LinkProfile, WanProxy

SWITCH_INTERVAL_S = 0.0005


class WanLinks:
    """Proxies, one per upstream, living in an event loop on a background thread."""

    def __init__(self, upstreams: list[str], profile: LinkProfile, seed: int = 0):
        self.upstreams = list(upstreams)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="wan-links", daemon=True)
        self._thread.start()
        self.proxies: list[WanProxy] = []
        try:
            for index, upstream in enumerate(self.upstreams):
                proxy = WanProxy(("127.0.0.1", 0), parse_address(upstream), profile, seed=seed + index)
                self.proxies.append(self._call(proxy.start()))
        except BaseException:
            self.close()
            raise

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    @property
    def addresses(self) -> list[str]:
        """Where to connect, in the order of the upstreams."""
        return ["%s:%d" % proxy.address for proxy in self.proxies]

    def profile(self, index: int) -> LinkProfile:
        return self.proxies[index].profile

    def set_profile(self, index: int, **changes) -> LinkProfile:
        """Change link `index` (rtt_s, jitter_s, bandwidth_bps); applies to bytes sent from now on."""
        return self._call(_apply(self.proxies[index], changes))

    def set_all(self, **changes) -> list[LinkProfile]:
        return [self.set_profile(index, **changes) for index in range(len(self.proxies))]

    def status(self) -> list[dict]:
        return [self._call(_status(proxy)) for proxy in self.proxies]

    def close(self) -> None:
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                self._call(proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _apply(proxy: WanProxy, changes: dict) -> LinkProfile:
    return proxy.set_profile(**changes)


async def _status(proxy: WanProxy) -> dict:
    return proxy.status()


@contextlib.contextmanager
def wan_links(upstreams: list[str], profile: LinkProfile, seed: int = 0) -> Iterator[WanLinks]:
    """One emulated link per upstream; yields the WanLinks; closes the proxies on exit."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    links = WanLinks(upstreams, profile, seed)
    try:
        yield links
    finally:
        links.close()
        sys.setswitchinterval(interval)
