"""Replicas and failover with real worker processes over TCP: a worker killed (SIGKILL) or stalled
(SIGSTOP) in the middle of a generation, with and without another holder of its experts.

Every generation here is compared with the local eager model step by step (`torch.equal` of the
logits): failover must keep exact mode bit-identical.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.engine.generate import generate
from moeswarm.tools.bench.injector import Injector
from moeswarm.local.workers import spawn_worker, split_experts, stop, wait_listening
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, " in the tiny byte-level vocabulary
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def reference(qwen2_moe):
    return load_local(qwen2_moe)


@pytest.fixture
def workers(qwen2_moe):
    """Start worker processes on demand; every one is stopped at the end of the test."""
    started = []

    def start(expert_sets, ports=None):
        processes = [spawn_worker(qwen2_moe, experts, port=port or 0)
                     for experts, port in zip(expert_sets, ports or [0] * len(expert_sets))]
        started.extend(processes)
        return processes, [wait_listening(p) for p in processes]

    yield start
    for process in started:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
    stop(started)


def _generate(swarm, reference):
    return generate(swarm, PROMPT, NEW_TOKENS, 0, reference)


def test_worker_killed_mid_generation_fails_over_then_is_readmitted(qwen2_moe, workers, reference, qwen2_replicas):
    # both hold all 8 experts: the first is this test's own (killed), the second conftest's (it outlives the test)
    processes, spawned = workers([list(range(8))])
    addresses = [*spawned, qwen2_replicas[1]]
    injector = Injector()
    with open_swarm(qwen2_moe, addresses, wrap_link=injector.watch) as swarm:
        injector.swarm = swarm
        injector.arm(7, lambda: processes[0].kill())  # prefill is calls 1-3: step 2
        result = _generate(swarm, reference)
        assert result.bit_identical is True and len(result.tokens) == NEW_TOKENS
        stats = swarm.resilience()
        assert stats["takedowns"] == 1 and stats["failovers"] >= 1
        standing = swarm.standing()
        assert [s["up"] for s in standing] == [False, True]
        assert "connection" in standing[0]["cause"].lower()  # reset mid-call, or refused on a retry
        assert swarm.health() == []  # the replica covers every expert: nothing stops a forward

        port = int(addresses[0].rsplit(":", 1)[1])
        workers([list(range(8))], ports=[port])  # back on the same address, same experts
        deadline = time.monotonic() + 30
        while not swarm.standing()[0]["up"] and time.monotonic() < deadline:
            swarm.health()  # probes a down holder once its backoff has run out
            time.sleep(0.2)
        assert swarm.standing()[0]["up"] is True and swarm.resilience()["readmissions"] == 1
        swarm.reset_accounting()
        assert _generate(swarm, reference).bit_identical is True
        assert addresses[0] in swarm.accounting()["worker_rtt_ms_mean"]  # its experts are served by it again


def test_without_a_replica_the_error_names_worker_layer_and_experts(qwen2_moe, workers, reference, qwen2_workers):
    # experts 0-3 on conftest's first worker, 4-7 on this test's own (killed)
    processes, spawned = workers(split_experts(8, 2)[1:])
    addresses = [qwen2_workers[0], *spawned]
    with open_swarm(qwen2_moe, addresses) as swarm:
        processes[0].kill()
        processes[0].wait()
        with pytest.raises(ExpertsUnavailable) as caught:
            _generate(swarm, reference)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f"worker {addresses[1]}: ")
        assert caught.value.experts and set(caught.value.experts) <= {4, 5, 6, 7}
        assert f"layer {caught.value.layer} experts " in message and "have no other usable holder" in message
        assert any("no usable worker holds" in line for line in swarm.health())


def test_stalled_worker_misses_its_deadline_and_its_share_moves(qwen2_moe, workers, reference, qwen2_replicas):
    # both hold all 8 experts: the first is conftest's, the second this test's own (stopped)
    processes, spawned = workers([list(range(8))])
    addresses = [qwen2_replicas[0], *spawned]
    injector = Injector()
    with open_swarm(qwen2_moe, addresses, reply_timeout_s=1.0, hedge=False, wrap_link=injector.watch) as swarm:
        injector.swarm = swarm
        injector.arm(10, lambda: os.kill(processes[0].pid, signal.SIGSTOP))
        started = time.monotonic()
        result = _generate(swarm, reference)
        elapsed = time.monotonic() - started
        stopped_standing = swarm.standing()[1]
        os.kill(processes[0].pid, signal.SIGCONT)
        assert stopped_standing["up"] is False and stopped_standing["degraded"] is True  # not "up" while stopped
        assert result.bit_identical is True
        stats = swarm.resilience()
        assert stats["deadline_misses"] == 1 and stats["failovers"] >= 1
        assert "deadline of 1 s" in swarm.standing()[1]["cause"]
        assert elapsed < 20  # one 1 s deadline, not 120 s


# -- hedging: a fake worker over TCP that stalls 1 call in 5 for 1 s ---------------------------


def _slow_every(n: int, seconds: float):
    from test_dispatcher import honest_reply

    def reply(worker, conn, frame):
        if worker.dispatches % n == 0:
            time.sleep(seconds)
        honest_reply(worker, conn, frame)

    return reply


@pytest.mark.parametrize("hedge", [True, False])
def test_hedging_cuts_the_tail_of_a_slow_worker(hedge):
    import torch
    from test_dispatcher import E, FakeWorker, _routing, reference as eager_sum, tcp_dispatcher

    from moeswarm.dispatch.health import DeadlinePolicy

    slow, fast = FakeWorker(list(range(E)), _slow_every(5, 1.0)), FakeWorker(list(range(E)))
    policy = DeadlinePolicy(floor_s=3.0, min_samples=4, hedge_min_samples=4, hedge=hedge)
    dispatcher = tcp_dispatcher([slow, fast], policy=policy)
    try:
        for call in range(16):
            hidden, index, weights = _routing(3, 100 + call)
            out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
            assert torch.equal(out, eager_sum(hidden, index, weights))
        seconds = [c.seconds for c in dispatcher.accounting.calls]
        stats = dispatcher.stats
        assert stats.takedowns == 0 and stats.failovers == 0  # slow is not failed: 1 s is within its 3 s floor
        if hedge:
            assert stats.hedges >= 1 and stats.hedge_wins >= 1
            assert max(seconds[4:]) < 0.5  # every stall after the warm-up was hedged away
        else:
            assert stats.hedges == 0 and max(seconds) >= 1.0
    finally:
        dispatcher.close()
        slow.close()
        fast.close()


# -- slow holders: a first deadline from the PING, degraded holders avoided ----------------------


def _late_from(n: int, seconds: float):
    """Honest, but from the n-th DISPATCH on each answer comes `seconds` late (PING stays fast)."""
    from test_dispatcher import honest_reply

    def reply(worker, conn, frame):
        if worker.dispatches >= n:
            time.sleep(seconds)
        honest_reply(worker, conn, frame)

    return reply


def test_a_worker_answering_10_s_late_is_failed_over_in_its_first_call_and_then_avoided():
    """No call measured yet: the first deadline comes from the PING round trip (2 s floor here),
    not the 120 s cap; the late holder is degraded and later calls go to the replica."""
    import torch
    from test_dispatcher import E, FakeWorker, _routing, reference as eager_sum, tcp_dispatcher

    late, fast = FakeWorker(list(range(E)), _late_from(1, 10.0)), FakeWorker(list(range(E)))
    dispatcher = tcp_dispatcher([late, fast])
    try:
        started = time.monotonic()
        for call in range(6):
            hidden, index, weights = _routing(2, 400 + call)
            assert torch.equal(dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights)),
                               eager_sum(hidden, index, weights))
            if call == 0:
                assert time.monotonic() - started < 4.0  # failed over after ~2 s, not 10 s or 120 s
        assert time.monotonic() - started < 6.0  # and not paid again by the later calls
        assert dispatcher.stats.deadline_misses == 1 and late.dispatches == 1
        assert [s["degraded"] for s in dispatcher.standing()] == [True, False]
        assert dispatcher.holders[0].ping_s is not None and dispatcher.holders[0].ping_s < 1.0
    finally:
        dispatcher.close()
        late.close()
        fast.close()


def test_a_holder_that_keeps_losing_hedges_is_degraded_and_calls_go_elsewhere():
    import torch
    from test_dispatcher import E, FakeWorker, _routing, reference as eager_sum, tcp_dispatcher

    from moeswarm.dispatch.health import DeadlinePolicy

    slow, fast = FakeWorker(list(range(E)), _late_from(7, 0.3)), FakeWorker(list(range(E)))
    policy = DeadlinePolicy(floor_s=3.0, min_samples=3, hedge_min_samples=3)
    dispatcher = tcp_dispatcher([slow, fast], policy=policy)
    try:
        for call in range(30):
            hidden, index, weights = _routing(3, 500 + call)
            assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)),
                               eager_sum(hidden, index, weights))
        assert dispatcher.stats.takedowns == 0  # 0.3 s is within its deadline: slow, not failed
        assert dispatcher.stats.hedge_wins >= policy.degraded_after
        assert dispatcher.standing()[0]["degraded"] is True and dispatcher.standing()[1]["degraded"] is False
        dispatches = slow.dispatches
        for call in range(10):
            hidden, index, weights = _routing(3, 600 + call)
            dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
        assert slow.dispatches == dispatches  # later calls went to the replica
        assert max(c.seconds for c in dispatcher.accounting.calls[-10:]) < 0.25
    finally:
        dispatcher.close()
        slow.close()
        fast.close()


def test_a_stalled_holder_does_not_stay_up():
    """A holder that stops answering anything (as a SIGSTOPped process does: its kernel still
    accepts connections) is down after its first missed deadline and stays down: probes fail."""
    import threading

    from test_dispatcher import E, FakeWorker, _routing, honest_hello, honest_reply, tcp_dispatcher

    stopped = threading.Event()

    def reply(worker, conn, frame):
        if stopped.is_set():
            time.sleep(30)
        honest_reply(worker, conn, frame)

    def hello(worker, frame):
        if stopped.is_set():
            time.sleep(30)
        return honest_hello(worker, frame)

    stalling, fast = FakeWorker(list(range(E)), reply, hello), FakeWorker(list(range(E)))
    dispatcher = tcp_dispatcher([stalling, fast])
    try:
        hidden, index, weights = _routing(2, 700)
        dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
        stopped.set()
        started = time.monotonic()
        for call in range(3):
            hidden, index, weights = _routing(2, 701 + call)
            dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
        assert dispatcher.standing()[0]["up"] is False
        dispatcher.readmit(due_only=False)  # a probe: HELLO gets no answer
        assert dispatcher.standing()[0]["up"] is False and dispatcher.standing()[1]["up"] is True
        assert time.monotonic() - started < 10.0
    finally:
        dispatcher.close()
        stalling.close()
        fast.close()
