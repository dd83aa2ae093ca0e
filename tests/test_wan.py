"""The WAN emulator: unit parsing, the link model, and a real proxy on loopback.

Timing checks are lower bounds only: the emulator adds delay, so a loaded machine can make things
slower than configured but never faster.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys

import pytest

from moeswarm_bench.wan.channel import Channel
from moeswarm_bench.wan.control import ControlServer, execute
from moeswarm_bench.wan.link import LinkProfile, format_bandwidth, parse_bandwidth, parse_duration
from moeswarm_bench.wan.measure import MeasureServer, measure_rtt, measure_throughput
from moeswarm_bench.wan.proxy import WanProxy

LOOPBACK = ("127.0.0.1", 0)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=15))


# -- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [("80ms", 0.08), ("0.08s", 0.08), ("80us", 80e-6), ("0", 0.0), ("1.5m", 90.0), (" 5 ms", 0.005), ("1e-3s", 1e-3)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["banana", "80", "-5ms", "80xs", "", "ms", "nan"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match=repr(text).replace("\\", "\\\\")):
        parse_duration(text)


@pytest.mark.parametrize(
    "text, bits_per_second",
    [
        ("100mbit", 100e6),
        ("1gbit", 1e9),
        ("10kbit", 10e3),
        ("12.5MB/s", 100e6),
        ("100Mb/s", 100e6),
        ("100mbit/s", 100e6),
        ("500kB/s", 4e6),
        ("1MiB/s", 8 * 2**20),
    ],
)
def test_parse_bandwidth(text, bits_per_second):
    assert parse_bandwidth(text) == pytest.approx(bits_per_second)


@pytest.mark.parametrize("text", ["banana", "100", "100mbps", "0mbit", "-1mbit", "10 furlongs", "1Xb/s"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError, match="bad bandwidth"):
        parse_bandwidth(text)


def test_profile_validates_and_describes():
    with pytest.raises(ValueError):
        LinkProfile(rtt_s=-1)
    with pytest.raises(ValueError):
        LinkProfile(rtt_s=0.1, bandwidth_bps=0)
    assert LinkProfile(0.08, 0.005, 1e8).describe() == "rtt=80ms jitter=5ms bandwidth=100mbit"
    assert format_bandwidth(parse_bandwidth("1gbit")) == "1gbit"


# -- the link model ----------------------------------------------------------------------------


def test_channel_serializes_then_propagates():
    channel = Channel(lambda: LinkProfile(rtt_s=0.2, bandwidth_bps=8000), random.Random(0))
    # 1000 bytes at 8000 bit/s occupy the link for 1 s, then travel 0.1 s.
    assert channel.schedule(1000, now=10.0) == pytest.approx(11.1)
    # The second chunk queues behind the first.
    assert channel.schedule(500, now=10.0) == pytest.approx(11.6)
    # An idle link starts at once.
    assert channel.schedule(0, now=20.0) == pytest.approx(20.1)


def test_channel_jitter_is_bounded_seeded_and_monotonic():
    profile = LinkProfile(rtt_s=0.02, jitter_s=0.008)
    arrivals = [Channel(lambda: profile, random.Random(7)) for _ in range(2)]
    times = [[c.schedule(10, now=i * 0.001) for i in range(500)] for c in arrivals]
    assert times[0] == times[1]  # same seed, same delays
    assert all(b >= a for a, b in zip(times[0], times[0][1:]))
    delays = [t - i * 0.001 for i, t in enumerate(times[0])]
    assert min(delays) >= 0.002 - 1e-9 and max(delays) <= 0.018 + 1e-9


# -- the proxy on loopback ---------------------------------------------------------------------


class Recorder:
    """An upstream that keeps every byte it receives and never answers."""

    def __init__(self):
        self.received = bytearray()
        self.closed = asyncio.Event()

    async def serve(self, reader, writer):
        while data := await reader.read(65536):
            self.received += data
        self.closed.set()
        writer.close()


async def echo_through(profile: LinkProfile, **proxy_options):
    server = await MeasureServer().start()
    proxy = await WanProxy(LOOPBACK, server.address, profile, seed=1, **proxy_options).start()
    return server, proxy


async def open_echo(proxy: WanProxy):
    reader, writer = await asyncio.open_connection(*proxy.address)
    writer.write(b"E")
    return reader, writer


def test_bytes_arrive_intact_both_ways():
    async def scenario():
        server, proxy = await echo_through(LinkProfile(rtt_s=0.002, jitter_s=0.001))
        reader, writer = await open_echo(proxy)
        for size in (1, 1000, 65537, 3 * 1024 * 1024 + 7):
            payload = random.Random(size).randbytes(size)
            writer.write(payload)
            echoed = await reader.readexactly(size)
            assert echoed == payload
        writer.close()
        await proxy.close()
        await server.close()

    run(scenario())


def test_rtt_is_applied_and_changes_apply_to_later_chunks():
    async def scenario():
        server, proxy = await echo_through(LinkProfile(rtt_s=0.08))
        rtts = await measure_rtt(*proxy.address, rounds=3)
        assert min(rtts) >= 0.075
        proxy.set_profile(rtt_s=0.0)
        assert min(await measure_rtt(*proxy.address, rounds=3)) < 0.075
        await proxy.close()
        await server.close()

    run(scenario())


def test_bandwidth_cap_is_applied():
    async def scenario():
        server, proxy = await echo_through(LinkProfile(rtt_s=0.0, bandwidth_bps=2e6))
        result = await measure_throughput(*proxy.address, 50_000)
        assert result["elapsed_s"] >= 0.18  # 50 KB at 2 Mbit/s is 0.2 s
        await proxy.close()
        await server.close()

    run(scenario())


def test_order_preserved_with_jitter():
    async def scenario():
        server, proxy = await echo_through(LinkProfile(rtt_s=0.01, jitter_s=0.009))
        reader, writer = await open_echo(proxy)
        sent = b"".join(i.to_bytes(4, "big") for i in range(2000))
        for start in range(0, len(sent), 40):  # many small writes: many chunks, many delays
            writer.write(sent[start : start + 40])
            await writer.drain()
            await asyncio.sleep(0)
        assert await reader.readexactly(len(sent)) == sent
        writer.close()
        await proxy.close()
        await server.close()

    run(scenario())


def test_reset_makes_the_client_see_a_reset():
    async def scenario():
        server, proxy = await echo_through(LinkProfile(rtt_s=0.0))
        reader, writer = await open_echo(proxy)
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        assert proxy.reset() == 1
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await reader.readexactly(1)
        writer.close()
        await proxy.close()
        await server.close()

    run(scenario())


def test_close_after_forwards_exactly_n_bytes_then_closes():
    async def scenario():
        recorder = Recorder()
        upstream = await asyncio.start_server(recorder.serve, *LOOPBACK)
        proxy = await WanProxy(LOOPBACK, upstream.sockets[0].getsockname()[:2], LinkProfile(0.0)).start()
        proxy.close_after(1000)
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(os.urandom(3000))
        assert await reader.read() == b""  # the client sees EOF
        await asyncio.wait_for(recorder.closed.wait(), 5)
        assert len(recorder.received) == 1000
        writer.close()
        await proxy.close()
        upstream.close()

    run(scenario())


def test_stall_delays_delivery():
    async def scenario():
        server, proxy = await echo_through(LinkProfile(rtt_s=0.0))
        loop = asyncio.get_running_loop()
        reader, writer = await open_echo(proxy)
        proxy.stall(0.3)
        start = loop.time()
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        assert loop.time() - start >= 0.28
        writer.close()
        await proxy.close()
        await server.close()

    run(scenario())


def test_control_commands():
    async def scenario():
        server, proxy = await echo_through(LinkProfile(rtt_s=0.01))
        control = await ControlServer(proxy, LOOPBACK).start()
        reader, writer = await asyncio.open_connection(*control.address)

        async def ask(line: str) -> str:
            writer.write(line.encode() + b"\n")
            return (await reader.readline()).decode().strip()

        assert (await ask("rtt 50ms")).startswith("ok rtt=50ms")
        assert (await ask("jitter 2ms")).startswith("ok")
        assert (await ask("bandwidth 10mbit")).endswith("bandwidth=10mbit")
        status = json.loads(await ask("status"))
        assert status["profile"] == {"rtt_s": 0.05, "jitter_s": 0.002, "bandwidth_bps": 1e7}
        assert (await ask("bandwidth off")).endswith("bandwidth=unlimited")
        assert "banana" in await ask("rtt banana")
        assert (await ask("frobnicate")).startswith("error: unknown command")
        assert (await ask("close-after 10")).startswith("ok")
        assert json.loads(await ask("status"))["faults"]["close_after_bytes"] == 10
        assert (await ask("stall 1s")).startswith("ok")
        assert (await ask("clear")).startswith("ok cleared: rtt=10ms")
        assert json.loads(await ask("status"))["faults"] == {"stall_remaining_s": 0.0, "close_after_bytes": None}

        echo_reader, echo_writer = await open_echo(proxy)
        echo_writer.write(b"x")
        await echo_reader.readexactly(1)
        assert await ask("reset") == "ok reset 1 connections"
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await echo_reader.readexactly(1)
        writer.close()
        echo_writer.close()
        await control.close()
        await proxy.close()
        await server.close()

    run(scenario())


def test_execute_rejects_bad_arguments():
    proxy = WanProxy(LOOPBACK, LOOPBACK, LinkProfile(0.01))
    assert execute(proxy, "").startswith("error")
    assert "-5ms" in execute(proxy, "rtt -5ms")
    assert execute(proxy, "rtt").startswith("error: rtt takes 1 argument")
    assert "lots" in execute(proxy, "close-after lots")
    assert proxy.profile.rtt_s == 0.01


# -- the command line --------------------------------------------------------------------------


def test_cli_proxy_subprocess():
    async def scenario():
        server = await MeasureServer().start()
        upstream = "%s:%d" % server.address
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "moeswarm.cli", "wan", "--listen", "127.0.0.1:0", "--upstream", upstream,
            "--rtt", "40ms", "--seed", "3",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            line = (await asyncio.wait_for(process.stdout.readline(), 10)).decode()
            assert line.startswith("wan: listening on 127.0.0.1:") and "rtt=40ms" in line, line
            port = int(line.split()[3].rsplit(":", 1)[1])
            rtts = await measure_rtt("127.0.0.1", port, rounds=3)
            assert min(rtts) >= 0.038
        finally:
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 10) == 0
            await server.close()

    run(scenario())


def test_cli_rejects_bad_flag(capsys):
    import argparse

    from moeswarm_bench.commands import wan

    parser = argparse.ArgumentParser(prog="moeswarm wan")
    wan.add_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--rtt", "banana"])
    assert exit_info.value.code == 2
    assert "argument --rtt: bad duration 'banana'" in capsys.readouterr().err
