"""A decode step's express call made in C (dispatch/lane.py): the same bits as eager and as a flight,
and whatever a reply brings that the lane does not take (an ERROR, a RESULT not as expected, an
implausible one, a broken stream) handled as the express call handles it.

Fake workers over real TCP (test_dispatcher's), one token per call; holders whose experts are
ranges, so that a token's experts never interleave between them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from test_dispatcher import E, FakeWorker, _routing, answer, reference, tcp_dispatcher
from test_malicious_worker import BAD_ANSWERS, DEADLINE
from test_spot_check import huge_row

from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.express_call import ExpressCall
from moeswarm.dispatch.flight import Flight
from moeswarm.dispatch.lane import LaneCall
from moeswarm.dispatch.wait import DOZE, SPIN_S
from moeswarm.transport import token_call
from moeswarm.wire.config import WireConfig
from moeswarm.wire.messages import Dispatch
from moeswarm.wire.stream import send_frame

pytestmark = pytest.mark.skipif(not token_call.available(), reason="moeswarm's C layer call is not built")

LOW, HIGH = list(range(E // 2)), list(range(E // 2, E))


def planned(dispatcher, *layers):
    """Plan `layers` as a first call would (a lane call needs the layer's owners known)."""
    for layer in layers:
        dispatcher.owners.of(layer)
    return dispatcher


def timed_reply(cpu_s: float):
    def reply(worker, conn, frame):
        request = Dispatch.from_frame(frame)
        send_frame(conn, answer(request).to_frame(frame.request_id, cpu_s if request.timed else None))
    return reply


@pytest.mark.parametrize("holders", [[ALL] for ALL in [list(range(E))]] + [[LOW, HIGH], [HIGH, LOW]])
def test_one_token_calls_go_in_c_with_the_bits_of_eager_and_of_a_flight(holders):
    workers = [FakeWorker(held) for held in holders]
    lane = planned(tcp_dispatcher(workers), 0)
    chained = planned(tcp_dispatcher(workers, fanout="chain"), 0)  # a flight always: the same adds in the same order
    try:
        for seed in range(12):
            hidden, index, weights = _routing(1, seed)
            handle = lane.dispatch(0, hidden, index, weights)
            assert isinstance(handle.flight, LaneCall)
            out = lane.combine(handle)
            assert torch.equal(out, reference(hidden, index, weights))
            assert torch.equal(out, chained.combine(chained.dispatch(0, hidden, index, weights)))
            call = lane.accounting.calls[-1]
            hit = {workers[i].address for i, held in enumerate(holders) if set(held) & set(index[0].tolist())}
            assert (call.tokens, call.round_trips, set(call.worker_seconds)) == (1, 1, hit)
        assert (lane.lane.calls, lane.lane.demotions) == (12, 0)
        assert all(link.direct_fd() is not None for link in lane.links)  # nothing left in flight or half-read
    finally:
        lane.close()
        chained.close()
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("late_s", [0.0, 0.004, 0.03])  # in the spin, late in it, after it (SPIN_S 10 ms)
def test_a_lane_call_that_spins_for_its_replies_takes_them_with_the_same_bits(late_s):
    """A call in the wait policy's spinning mode (dispatch/wait.py) takes replies that come while it
    spins and those that come after it gave up spinning and sleeps in poll, with eager's bits."""
    def late_reply(worker, conn, frame):
        time.sleep(late_s)
        send_frame(conn, answer(Dispatch.from_frame(frame)).to_frame(frame.request_id))

    workers = [FakeWorker(LOW, late_reply), FakeWorker(HIGH, late_reply)]
    dispatcher = planned(tcp_dispatcher(workers), 0)
    dispatcher.wait.spin_s = lambda: SPIN_S
    try:
        for seed in range(4):
            hidden, index, weights = _routing(1, seed)
            handle = dispatcher.dispatch(0, hidden, index, weights)
            assert isinstance(handle.flight, LaneCall)
            assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
        assert (dispatcher.lane.calls, dispatcher.lane.demotions) == (4, 0)
    finally:
        dispatcher.close()
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("late_s", [0.0, 0.004, 0.012, 0.03])  # in the doze (7 ms), the spin after it, poll after that
def test_a_lane_call_that_dozes_for_its_replies_is_woken_by_them_with_the_same_bits(late_s):
    """A call in the wait policy's dozing mode sleeps through 70 % of its holder's median round trip
    (10 ms here), woken by a reply that comes meanwhile, then spins, then sleeps in poll: it takes
    each with eager's bits. A holder measured at 5 s a trip: a reply that comes at once ends the
    doze (3.5 s) at once."""
    def late_reply(worker, conn, frame):
        time.sleep(late_s)
        send_frame(conn, answer(Dispatch.from_frame(frame)).to_frame(frame.request_id))

    workers = [FakeWorker(LOW, late_reply), FakeWorker(HIGH, late_reply)]
    dispatcher = planned(tcp_dispatcher(workers), 0)
    dispatcher.wait.observe = lambda now: None
    dispatcher.wait.mode = DOZE
    try:
        for trip_s in (0.01, 5.0):
            for holder in dispatcher.pool.holders:
                for _ in range(200):
                    holder.round_trips.record(trip_s, 1)
                assert holder.round_trips.quantile(0.5, 1) == trip_s
            for seed in range(3):
                hidden, index, weights = _routing(1, seed)
                started = time.perf_counter()
                handle = dispatcher.dispatch(0, hidden, index, weights)
                assert isinstance(handle.flight, LaneCall)
                assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
                if trip_s == 5.0:
                    assert time.perf_counter() - started < 2.0  # woken by the reply, not by the doze's end
            if late_s:
                break  # a 5 s median makes every later reply a timeout's business
        assert dispatcher.lane.demotions == 0
    finally:
        dispatcher.close()
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("cpu_s", [5e-6, 300e-6, 0.07])  # msgpack: a fixint, a uint16, a uint32
def test_a_timed_result_s_cpu_time_is_read_from_its_metadata(cpu_s):
    workers = [FakeWorker(LOW, timed_reply(cpu_s)), FakeWorker(HIGH, timed_reply(cpu_s))]
    dispatcher = planned(tcp_dispatcher(workers, wire=WireConfig(timings=True)), 0)
    try:
        hidden, index, weights = _routing(1, 4)
        handle = dispatcher.dispatch(0, hidden, index, weights)
        assert isinstance(handle.flight, LaneCall)
        assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
        assert dispatcher.lane.calls == 1
        said = dispatcher.accounting.calls[-1].worker_cpu
        assert said and all(value == int(cpu_s * 1e6) * 1e-6 for value in said.values())
    finally:
        dispatcher.close()
        for worker in workers:
            worker.close()


def test_a_result_without_the_time_asked_for_is_handed_to_the_express_call_and_used():
    workers = [FakeWorker(list(range(E)))]  # honest, but never says its CPU time
    dispatcher = planned(tcp_dispatcher(workers, wire=WireConfig(timings=True)), 0)
    try:
        hidden, index, weights = _routing(1, 5)
        handle = dispatcher.dispatch(0, hidden, index, weights)
        assert isinstance(handle.flight, LaneCall)
        assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
        assert (dispatcher.lane.calls, dispatcher.lane.demotions, dispatcher.stats.takedowns) == (0, 1, 0)
        assert dispatcher.links[0].direct_fd() is not None  # the reply was used: nothing is awaited
    finally:
        dispatcher.close()
        workers[0].close()


def test_holders_whose_experts_interleave_go_express():
    workers = [FakeWorker([0, 2, 4, 6]), FakeWorker([1, 3, 5, 7])]
    dispatcher = planned(tcp_dispatcher(workers), 0)
    try:
        hidden, _, _ = _routing(1, 22)
        index, weights = torch.tensor([[3, 2, 1]]), torch.tensor([[0.5, 0.3, 0.2]])  # b, a, b: interleaved
        handle = dispatcher.dispatch(0, hidden, index, weights)
        assert isinstance(handle.flight, ExpressCall)
        assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
    finally:
        dispatcher.close()
        for worker in workers:
            worker.close()


def hang_up(worker, conn, frame):
    conn.shutdown(2)


BAD = {**BAD_ANSWERS, "hangs up": (hang_up, "connection closed by the worker (is it down?)")}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_answer_without_a_replica_is_one_line_naming_worker_layer_experts(case):
    behaviour, cause = BAD[case]
    bad, honest = FakeWorker(LOW, behaviour), FakeWorker(HIGH)
    dispatcher = planned(tcp_dispatcher([bad, honest], policy=DEADLINE), 1)
    try:
        hidden, index, weights = _routing(1, 1)  # experts 5 and 1: both holders
        hit = sorted(e for e in index.flatten().tolist() if e in LOW)
        assert hit, "the token must need the bad holder"
        started = time.monotonic()
        handle = dispatcher.dispatch(1, hidden, index, weights)
        assert isinstance(handle.flight, LaneCall)
        with pytest.raises(ExpertsUnavailable) as caught:
            dispatcher.combine(handle)
        assert time.monotonic() - started < 5.0  # 1 s deadlines: asked in C, then once more after a probe
        message = str(caught.value)
        assert message.startswith(f"worker {bad.address}: ") and cause in message and message.isprintable()
        assert message.endswith(f"layer 1 experts {','.join(map(str, hit))} have no other usable holder")
        assert dispatcher.lane.calls == 0
        assert not dispatcher.links[1].broken  # the honest holder's stream is still in step (a reply may be owed)
    finally:
        dispatcher.close()
        bad.close()
        honest.close()


def test_an_implausible_answer_is_settled_by_the_referee_and_never_reaches_the_output():
    liar = FakeWorker(list(range(E)), huge_row)
    dispatcher = planned(tcp_dispatcher([liar], referee=answer), 0)
    try:
        hidden, index, weights = _routing(1, 90)
        handle = dispatcher.dispatch(0, hidden, index, weights)
        assert isinstance(handle.flight, LaneCall)
        assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
        assert dispatcher.holders[0].banned and "implausible RESULT" in dispatcher.holders[0].cause
        assert (dispatcher.stats.implausible, dispatcher.lane.demotions) == (1, 1)
    finally:
        dispatcher.close()
        liar.close()


def test_a_connection_lost_before_the_send_takes_its_holder_down_and_the_call_goes_as_a_flight():
    workers = [FakeWorker(LOW), FakeWorker(HIGH)]
    dispatcher = planned(tcp_dispatcher(workers), 0)
    try:
        hidden, index, weights = _routing(1, 1)  # experts 5 and 1: both holders
        assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)),
                           reference(hidden, index, weights))
        dispatcher.links[0]._sock.shutdown(2)  # the connection is gone (as when the worker restarts)
        handle = dispatcher.dispatch(0, hidden, index, weights)
        assert isinstance(handle.flight, Flight) and dispatcher.stats.takedowns == 1  # the send failed in C
        assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
        assert dispatcher.stats.takedowns == 1 and dispatcher.stats.readmissions == 1
        out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))  # back in C
        assert torch.equal(out, reference(hidden, index, weights)) and dispatcher.lane.calls == 2
    finally:
        dispatcher.close()
        for worker in workers:
            worker.close()


def test_a_decode_over_two_worker_processes_makes_every_one_token_call_in_c_bit_identically(trained_workers):
    """What a user runs: `generate --check-local` over two `moeswarm worker` processes (experts 0-15
    and 16-31 of the bundled model); every decode step's layer calls go in C, none handed back."""
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", "models/pymoe/hf",
                           "--workers", ",".join(trained_workers), "--prompt", "def main(", "--max-new-tokens", "10",
                           "--check-local", "--json", "--threads", "2", "--speculate", "0"],  # one-token steps
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["bit_identical"] is True
    decode_steps = len(report["tokens"]) - 1  # the prompt's forward gives the first token
    assert report["layer_calls_in_c"] == decode_steps * report["moe_layers"] > 0, report["layer_calls"]


def test_two_lane_calls_in_flight_at_once_are_each_answered_and_accounted():
    """Groups in flight: a call to one holder and another to the other, combined in turn; each one's
    bookkeeping (left for the next call's send) is recorded, none lost."""
    workers = [FakeWorker(LOW), FakeWorker(HIGH)]
    dispatcher = planned(tcp_dispatcher(workers), 0, 1)
    try:
        hidden, _, _ = _routing(1, 3)
        weights = torch.tensor([[0.6, 0.4]])
        low, high = torch.tensor([[1, 0]]), torch.tensor([[6, 5]])
        first, second = dispatcher.dispatch(0, hidden, low, weights), dispatcher.dispatch(1, hidden, high, weights)
        assert isinstance(first.flight, LaneCall) and isinstance(second.flight, LaneCall)
        assert torch.equal(dispatcher.combine(first), reference(hidden, low, weights))
        assert torch.equal(dispatcher.combine(second), reference(hidden, high, weights))
        calls = dispatcher.accounting.calls
        assert [(c.layer, c.in_c, set(c.worker_seconds)) for c in calls] == [
            (0, True, {workers[0].address}), (1, True, {workers[1].address})]
        assert [len(holder.round_trips) for holder in dispatcher.holders] == [1, 1]
    finally:
        dispatcher.close()
        for worker in workers:
            worker.close()


def test_a_lane_call_is_recorded_by_the_thread_that_made_it():
    """A dashboard reading from another thread sees a lane call's bookkeeping a call late; it never
    writes the holders' statistics itself."""
    import threading

    workers = [FakeWorker(list(range(E)))]
    dispatcher = planned(tcp_dispatcher(workers), 0)
    try:
        hidden, index, weights = _routing(1, 2)
        assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)),
                           reference(hidden, index, weights))
        seen = []
        reader = threading.Thread(target=lambda: seen.append((len(dispatcher.accounting.calls),
                                                              len(dispatcher.holders[0].round_trips))))
        reader.start()
        reader.join()
        assert seen == [(0, 0)]
        assert (len(dispatcher.accounting.calls), len(dispatcher.holders[0].round_trips)) == (1, 1)
    finally:
        dispatcher.close()
        workers[0].close()
