"""How close is the emulated link to the configured one? Measure it through the proxy.

A MeasureServer answers two kinds of connection, chosen by the first byte:
  b"E": echo every byte back (round-trip times of a small message: ping-pong);
  b"S" + 8-byte big-endian length: swallow that many bytes, then answer one JSON line with the
        time between the first and the last byte received (the link rate, free of latency).
`run_selftest` puts a proxy in front of one and returns configured versus measured numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import struct

from moeswarm_bench.wan.clock import DEFAULT_SPIN_S, sleep_until
from moeswarm_bench.wan.connection import set_nodelay
from moeswarm_bench.wan.link import LinkProfile
from moeswarm_bench.wan.proxy import WanProxy

_LENGTH = struct.Struct(">Q")


class MeasureServer:
    """Echo and sink server for measurements (see the module docstring)."""

    def __init__(self, listen: tuple[str, int] = ("127.0.0.1", 0)):
        self._listen = listen
        self._server: asyncio.Server | None = None

    async def start(self) -> MeasureServer:
        self._server = await asyncio.start_server(self._serve, *self._listen)
        return self

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "MeasureServer.start() has not run"
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        set_nodelay(writer)
        try:
            mode = await reader.readexactly(1)
            if mode == b"E":
                while data := await reader.read(64 * 1024):
                    writer.write(data)
                    await writer.drain()
            elif mode == b"S":
                await self._sink(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # cancelled: shutting down (a server-callback task; see proxy._accept)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _sink(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        (expected,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        received, first_chunk, first_at, last_at = 0, 0, 0.0, 0.0
        while received < expected:
            data = await reader.read(min(64 * 1024, expected - received))
            if not data:
                raise asyncio.IncompleteReadError(b"", expected - received)
            last_at = loop.time()
            if received == 0:
                first_chunk, first_at = len(data), last_at
            received += len(data)
        report = {"bytes": received, "first_chunk_bytes": first_chunk, "first_to_last_s": last_at - first_at}
        writer.write((json.dumps(report) + "\n").encode())
        await writer.drain()


async def measure_rtt(host: str, port: int, rounds: int = 50, size: int = 64) -> list[float]:
    """Round-trip times (seconds) of `rounds` ping-pongs of a `size`-byte message, after a warm-up."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(host, port)
    set_nodelay(writer)
    message = os.urandom(size)
    samples: list[float] = []
    try:
        writer.write(b"E")
        for round_index in range(rounds + 2):
            start = loop.time()
            writer.write(message)
            await writer.drain()
            if await reader.readexactly(size) != message:
                raise RuntimeError("echo came back corrupted")
            if round_index >= 2:  # the first two include connection warm-up
                samples.append(loop.time() - start)
    finally:
        writer.close()
    return samples


async def measure_throughput(host: str, port: int, n_bytes: int) -> dict[str, float]:
    """Send `n_bytes` one way; return the link rate seen by the receiver and the goodput."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(host, port)
    set_nodelay(writer)
    block = os.urandom(min(n_bytes, 1024 * 1024))
    start = loop.time()
    try:
        writer.write(b"S" + _LENGTH.pack(n_bytes))
        sent = 0
        while sent < n_bytes:
            piece = block[: n_bytes - sent]
            writer.write(piece)
            sent += len(piece)
            await writer.drain()
        report = json.loads(await reader.readline())
    finally:
        writer.close()
    elapsed = loop.time() - start
    after_first = report["bytes"] - report["first_chunk_bytes"]
    return {
        "bytes": n_bytes,
        "elapsed_s": elapsed,
        "receive_span_s": report["first_to_last_s"],
        "link_bps": after_first * 8 / report["first_to_last_s"] if report["first_to_last_s"] > 0 else 0.0,
        "goodput_bps": n_bytes * 8 / elapsed,
    }


async def timer_overshoot(spin_s: float, samples: int = 30, delay_s: float = 0.005) -> dict[str, float]:
    """How late `sleep_until` wakes (seconds, p50/p90/max) with a given spin window."""
    loop = asyncio.get_running_loop()
    late = []
    for _ in range(samples):
        target = loop.time() + delay_s
        await sleep_until(target, spin_s)
        late.append(loop.time() - target)
    return _percentiles(late)


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_s": pick(0.5), "p90_s": pick(0.9), "max_s": ordered[-1], "mean_s": statistics.fmean(ordered)}


def default_transfer_bytes(profile: LinkProfile) -> int:
    """About one second of transfer at the configured rate, within [256 KiB, 64 MiB]."""
    if profile.bandwidth_bps is None:
        return 64 * 1024 * 1024
    return int(min(64 * 1024 * 1024, max(256 * 1024, profile.bandwidth_bps / 8)))


async def run_selftest(
    profile: LinkProfile,
    *,
    rounds: int = 50,
    n_bytes: int | None = None,
    seed: int = 0,
    spin_s: float = DEFAULT_SPIN_S,
) -> dict:
    """Echo server + proxy in this process; returns configured versus measured RTT and rate."""
    n_bytes = n_bytes or default_transfer_bytes(profile)
    server = await MeasureServer().start()
    try:
        direct = await measure_rtt(*server.address, rounds=rounds)
        async with WanProxy(("127.0.0.1", 0), server.address, profile, seed=seed, spin_s=spin_s) as proxy:
            rtts = await measure_rtt(*proxy.address, rounds=rounds)
            throughput = await measure_throughput(*proxy.address, n_bytes)
            timers = {
                "asyncio_sleep_late": await timer_overshoot(0.0),
                "spin_late": await timer_overshoot(proxy.spin_s),
                "spin_s": proxy.spin_s,
            }
    finally:
        await server.close()
    rtt = _percentiles(rtts)
    rtt.update(n=len(rtts), configured_s=profile.rtt_s, direct_p50_s=_percentiles(direct)["p50_s"])
    rtt["p50_error_s"] = rtt["p50_s"] - profile.rtt_s
    throughput["configured_bps"] = profile.bandwidth_bps
    if profile.bandwidth_bps:
        throughput["link_ratio"] = throughput["link_bps"] / profile.bandwidth_bps
    return {"profile": profile.to_dict(), "rtt": rtt, "throughput": throughput, "timer": timers}
