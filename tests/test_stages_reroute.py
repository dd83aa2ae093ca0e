"""A running gateway re-plans its route as the swarm's stages change, bit-identical throughout.

The gateway finds stages 0-2 and 3-5 on the DHT. (1) A stage of every layer is announced later:
the watch's next read moves the chain to that one-stage route between two steps (the new stage
replays the logged steps, so its caches are the old route's), and every logit row after it is
torch.equal to the local model's. (2) Stages 0-1 and 2-5 are announced (no fewer stages: no
move), then the stage of 3-5, which has no replica, dies: the chain asks the watch for a route of
the stages alive, takes 0-1 and 2-5 (the only tiling left but the first stage's 0-2, which
cannot reach layer 6), replays, and the outputs stay equal. (3) The stage of 0-2 is reached
through a WAN proxy adding a round trip; stages 0-1 and 2-5 announced without it make a route of
as many stages but clearly cheaper: the chain moves to it, and the outputs stay equal. (4) The
chain runs on 0-2 and 3-5 beside a stage of every layer reached through a WAN proxy adding 30 ms a
round trip; then the link to 0-2 slows down by 80 ms a round trip: once its round trip is measured
again (`remeasure_s`), the one-stage route is clearly cheaper, the chain moves to it, and the
outputs stay equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import subprocess
import threading
import time

import pytest
from swarm_processes import announced, lines_until

MODEL = "models/pymoe/hf"  # 6 decoder layers
THREADS = 1


@pytest.fixture()
def swarm():
    """(the DHT peer, started stage processes list, spawn(span) -> (process, address))."""
    pytest.importorskip("hivemind")
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import stop

    meeting = SwarmDht.open([], host="127.0.0.1")
    peer = meeting.addresses()[0]
    started: list[subprocess.Popen] = []

    def spawn(*spans: str) -> list[str]:
        new = [spawn_stage(MODEL, span, threads=THREADS, extra_args=["--announce-swarm", peer]) for span in spans]
        started.extend(new)
        return [announced(lines_until(process, "announced on the swarm as ")) for process in new]

    try:
        yield peer, started, spawn
    finally:
        stop(started)
        meeting.close()


def _gateway(peer: str, lines: list[str], **search):
    import torch

    from moeswarm.forward.packed import PackedStepper, install
    from moeswarm.sources.loading import load_local
    from moeswarm.sources.source import open_source
    from moeswarm.stages.find import StageSearch, watch_stages
    from moeswarm.stages.gateway import open_gateway

    torch.set_num_threads(THREADS)  # the reference computes as the stages do
    watch = watch_stages(StageSearch((peer,), report=lines.append, follow_s=0.5, **search), open_source(MODEL), None)
    reference = load_local(MODEL)
    install(reference)
    gateway = open_gateway(MODEL, watch.route, watch=watch)
    install(gateway.model)
    return gateway, gateway.model.base_model.layers[0].chain, PackedStepper(gateway.model), PackedStepper(reference)


def _steps(got, want, feed: list[int], count: int) -> list[int]:
    import torch

    for _ in range(count):
        out = got.forward(feed)
        assert torch.equal(out, want.forward(feed))
        feed = [int(out[-1].argmax())]
    return feed


def test_a_route_of_fewer_stages_announced_later_is_taken_between_steps_bit_identical(swarm):
    peer, _, spawn = swarm
    first, second = spawn("0-2", "3-5")
    lines: list[str] = []
    gateway, chain, got, want = _gateway(peer, lines)
    with gateway:
        assert chain.route == [first, second]
        feed = _steps(got, want, list(range(10, 30)), 2)
        (whole,) = spawn("0-5")
        deadline = time.monotonic() + 30
        while chain.reroutes == 0:  # the watch's thread reads every 0.5 s
            assert time.monotonic() < deadline, f"the route never changed: {lines}"
            time.sleep(0.1)
        assert chain.route == [whole] and chain.spans == [range(0, 6)]
        assert any(f"re-planned the route: layers 0-5 at {whole}" in line for line in lines), lines
        _steps(got, want, feed, 3)
        assert chain.failovers == 0


def test_a_span_that_lost_every_replica_is_replaced_by_another_tiling_bit_identical(swarm):
    peer, started, spawn = swarm
    first, second = spawn("0-2", "3-5")
    lines: list[str] = []
    gateway, chain, got, want = _gateway(peer, lines)
    with gateway:
        feed = _steps(got, want, list(range(10, 30)), 2)
        head, tail = spawn("0-1", "2-5")
        time.sleep(1.5)  # the watch has read them: two stages either way, so the route stays
        assert chain.route == [first, second] and chain.reroutes == 0
        started[1].kill()  # the stage of 3-5, without a replica, dies between two steps
        started[1].wait()
        _steps(got, want, feed, 3)
        assert chain.route == [head, tail] and chain.failovers == 1
        assert any(f"re-planned the route: layers 0-1 at {head}, layers 2-5 at {tail}" in line for line in lines)


@contextlib.contextmanager
def _behind_delay(address: str, rtt_s: float):
    """A WAN proxy adding `rtt_s` to every round trip to the stage at `address`; yields its HOST:PORT
    and a function setting the round trip it adds from then on (seconds)."""
    from moeswarm_bench.wan import LinkProfile, WanProxy

    host, _, port = address.rpartition(":")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = WanProxy(("127.0.0.1", 0), (host, int(port)), LinkProfile(rtt_s=rtt_s), spin_s=0.0)
    try:
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
        yield "127.0.0.1:%d" % proxy.address[1], lambda rtt_s: loop.call_soon_threadsafe(
            functools.partial(proxy.set_profile, rtt_s=rtt_s))
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_route_of_as_many_stages_without_a_delay_is_taken_bit_identical(swarm):
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.discovery.stage_record import STAGES
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import wait_listening
    from moeswarm.sources.source import open_source

    peer, started, spawn = swarm
    (second,) = spawn("3-5")
    started.append(spawn_stage(MODEL, "0-2", threads=THREADS))  # not announced: the test announces its proxy
    source = open_source(MODEL)
    with _behind_delay(wait_listening(started[-1]), 0.06) as (delayed, _):
        announcer = SwarmDht.open([peer], host="127.0.0.1")
        try:
            assert announcer.store(_record(source, delayed, range(0, 3)), 120, kind=STAGES)
            lines: list[str] = []
            gateway, chain, got, want = _gateway(peer, lines)
            with gateway:
                assert chain.route == [delayed, second]
                feed = _steps(got, want, list(range(10, 30)), 2)
                head, tail = spawn("0-1", "2-5")
                deadline = time.monotonic() + 30
                while chain.reroutes == 0:
                    assert time.monotonic() < deadline, f"the route never changed: {lines}"
                    time.sleep(0.1)
                assert chain.route == [head, tail] and chain.spans == [range(0, 2), range(2, 6)]
                assert any(f"re-planned the route: layers 0-1 at {head}, layers 2-5 at {tail} (cost" in line
                           for line in lines), lines
                _steps(got, want, feed, 3)
                assert chain.failovers == 0 and chain.reroutes == 1
        finally:
            announcer.close()


def _record(source, address: str, layers: range):
    from moeswarm.discovery.stage_record import StageRecord

    return StageRecord(address, source.fingerprint, source.config.model_type, layers,
                       source.config.get_text_config().hidden_size, tls=False)


def test_a_stage_whose_link_slows_down_is_left_for_a_route_now_cheaper_bit_identical(swarm):
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.discovery.stage_record import STAGES
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import wait_listening
    from moeswarm.sources.source import open_source

    peer, started, spawn = swarm
    (second,) = spawn("3-5")
    first_stage, whole_stage = (spawn_stage(MODEL, span, threads=THREADS) for span in ("0-2", "0-5"))
    started.extend((first_stage, whole_stage))  # not announced: the test announces their proxies
    source = open_source(MODEL)
    with _behind_delay(wait_listening(first_stage), 0.0) as (first, slow_down), \
            _behind_delay(wait_listening(whole_stage), 0.03) as (whole, _):
        announcer = SwarmDht.open([peer], host="127.0.0.1")
        try:
            for address, layers in ((first, range(0, 3)), (whole, range(0, 6))):
                assert announcer.store(_record(source, address, layers), 120, kind=STAGES)
            lines: list[str] = []
            gateway, chain, got, want = _gateway(peer, lines, remeasure_s=1.0)
            with gateway:
                # 2 x 10 ms weight + loopback beats 10 ms + 30 ms: the route of two stages is taken
                assert chain.route == [first, second]
                feed = _steps(got, want, list(range(10, 30)), 2)
                slow_down(0.08)  # now 2 x 10 + 80 ms against 40 ms, once 0-2 is measured again
                deadline = time.monotonic() + 30
                while chain.reroutes == 0:
                    assert time.monotonic() < deadline, f"the route never changed: {lines}"
                    time.sleep(0.1)
                assert chain.route == [whole] and chain.spans == [range(0, 6)]
                assert any(f"re-planned the route: layers 0-5 at {whole} (cost" in line for line in lines), lines
                _steps(got, want, feed, 3)
                assert chain.failovers == 0 and chain.reroutes == 1
        finally:
            announcer.close()
