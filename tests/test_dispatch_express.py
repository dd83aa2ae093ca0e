"""A decode step's layer call goes express (dispatch/express_call.py): the same bits as a flight, and
whatever goes wrong in it (a lost holder, a bad answer, an implausible one) handled as a flight
handles it, because the call is then made again as one.

In-process fake links and fake workers over real TCP (test_dispatcher's), one token per call.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_dispatcher import E, FakeLink, FakeWorker, _dispatcher, _routing, answer, reference, tcp_dispatcher
from test_malicious_worker import BAD_ANSWERS, DEADLINE
from test_spot_check import huge_row

from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.express_call import ExpressCall
from moeswarm.dispatch.flight import Flight
from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.dispatch.spot_check import SpotCheckPolicy
from moeswarm.placement.table import build_table
from moeswarm.wire.config import CombineMode, WireConfig

ALL = list(range(E))


@pytest.mark.parametrize("seed", range(4))
def test_a_one_token_call_goes_express_with_the_bits_of_eager_and_of_a_flight(seed):
    express, _ = _dispatcher()
    chained, _ = _dispatcher(fanout="chain")  # a flight always: the same adds in the same order
    hidden, index, weights = _routing(1, seed)
    handle = express.dispatch(0, hidden, index, weights)
    assert isinstance(handle.flight, ExpressCall)
    out = express.combine(handle)
    flown = chained.dispatch(0, hidden, index, weights)
    assert isinstance(flown.flight, Flight)
    assert torch.equal(out, chained.combine(flown)) and torch.equal(out, reference(hidden, index, weights))
    call = express.accounting.calls[0]
    hit = {"ab"[e % 2] for e in index.flatten().tolist()}  # a holds the even experts, b the odd
    assert (call.tokens, call.round_trips, call.worker_seconds) == (1, 1, {holder: 0.001 for holder in hit})


class Remote(FakeLink):
    """A fake link with a socket to select on, that notes when it is awaited."""

    def __init__(self, name, held, awaited):
        super().__init__(name, held)
        self.awaited = awaited

    def fileno(self):
        return 99

    def wait(self, pending, deadline):
        self.awaited.append(self.address)
        return super().wait(pending, deadline)


class Here(Remote):
    def fileno(self):
        return None  # computed when awaited, as this process's experts are


def test_experts_computed_here_are_awaited_first_while_the_others_replies_are_on_the_wire():
    awaited = []
    links = [Remote("far", [0, 2, 4, 6], awaited), Here("here", [1, 3, 5, 7], awaited)]
    dispatcher = Dispatcher(links, build_table({i: link.info.held for i, link in enumerate(links)}, E))
    hidden, index, weights = _routing(1, 22)  # experts 5 and 4: both holders
    handle = dispatcher.dispatch(0, hidden, index, weights)
    assert isinstance(handle.flight, ExpressCall)
    assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
    assert awaited == ["here", "far"]


def test_calls_that_may_need_a_flight_do_not_go_express():
    hidden, index, weights = _routing(2, 0)
    dispatcher, _ = _dispatcher()
    assert isinstance(dispatcher.dispatch(0, hidden, index, weights).flight, Flight)  # two tokens
    lossy, _ = _dispatcher(WireConfig(CombineMode.PARTIAL))
    assert isinstance(lossy.dispatch(0, hidden[:1], index[:1], weights[:1]).flight, Flight)
    replicas = [FakeWorker(ALL), FakeWorker(ALL)]  # every expert twice: hedges and a per-call choice
    checked = [FakeWorker(ALL)]
    try:
        assert isinstance(tcp_dispatcher(replicas).dispatch(0, hidden[:1], index[:1], weights[:1]).flight, Flight)
        spot = tcp_dispatcher(checked, spot_checks=SpotCheckPolicy(fraction=0.5))
        assert isinstance(spot.dispatch(0, hidden[:1], index[:1], weights[:1]).flight, Flight)
    finally:
        for worker in replicas + checked:
            worker.close()


def test_a_holder_lost_while_answering_is_probed_and_asked_again_in_the_same_call():
    dispatcher, (a, b) = _dispatcher()
    a.fail_wait = True
    hidden, index, weights = _routing(1, 3)
    handle = dispatcher.dispatch(0, hidden, index, weights)
    assert isinstance(handle.flight, ExpressCall)
    assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights)) and a.reconnects == 1
    assert (dispatcher.stats.takedowns, dispatcher.stats.readmissions) == (1, 1)
    assert a.queue == [] and b.queue == [] and not a.broken and not b.broken


def test_a_holder_lost_while_sending_is_probed_and_the_call_made_as_a_flight():
    dispatcher, (a, b) = _dispatcher()
    b.fail_send = True
    hidden, index, weights = _routing(1, 22)  # experts 5 and 4: both holders
    handle = dispatcher.dispatch(0, hidden, index, weights)
    assert isinstance(handle.flight, Flight)
    assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights)) and b.reconnects == 1
    assert (dispatcher.stats.takedowns, dispatcher.stats.readmissions) == (1, 1)
    assert a.queue == [] and b.queue == []


def test_a_degraded_holder_s_calls_go_as_flights():
    dispatcher, _ = _dispatcher()
    dispatcher.holders[1].degrade(time.monotonic())
    hidden, index, weights = _routing(1, 22)
    handle = dispatcher.dispatch(0, hidden, index, weights)
    assert isinstance(handle.flight, Flight)
    assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_bad_answer_without_a_replica_is_one_line_naming_worker_layer_experts(case):
    behaviour, cause = BAD_ANSWERS[case]
    bad, honest = FakeWorker([0, 2, 4, 6], behaviour), FakeWorker([1, 3, 5, 7])
    dispatcher = tcp_dispatcher([bad, honest], policy=DEADLINE)
    try:
        hidden, index, weights = _routing(1, 22)  # experts 5 and 4: both holders
        hit = sorted(e for e in index.flatten().tolist() if e % 2 == 0)
        assert hit, "the token must need the bad holder"
        started = time.monotonic()
        handle = dispatcher.dispatch(1, hidden, index, weights)
        assert isinstance(handle.flight, ExpressCall)
        with pytest.raises(ExpertsUnavailable) as caught:
            dispatcher.combine(handle)
        assert time.monotonic() - started < 5.0  # 1 s deadlines: asked express, then once more after a probe
        message = str(caught.value)
        assert message.startswith(f"worker {bad.address}: ") and cause in message and message.isprintable()
        assert message.endswith(f"layer 1 experts {','.join(map(str, hit))} have no other usable holder")
    finally:
        dispatcher.close()
        bad.close()
        honest.close()


def test_an_implausible_express_answer_is_settled_by_the_referee_and_never_reaches_the_output():
    liar = FakeWorker(ALL, huge_row)  # the only holder: no replica, so its calls go express
    dispatcher = tcp_dispatcher([liar], referee=answer)
    try:
        hidden, index, weights = _routing(1, 90)
        handle = dispatcher.dispatch(0, hidden, index, weights)
        assert isinstance(handle.flight, ExpressCall)
        assert torch.equal(dispatcher.combine(handle), reference(hidden, index, weights))
        assert dispatcher.holders[0].banned and "implausible RESULT" in dispatcher.holders[0].cause
        assert dispatcher.stats.implausible == 1
    finally:
        dispatcher.close()
        liar.close()
