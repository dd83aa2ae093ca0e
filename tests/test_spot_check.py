"""Spot checks against lying workers over TCP: caught, banned, and the lie never reaches the output
when the share it sat in was checked.

Fake workers (threads on 127.0.0.1, real TCP) compute the stand-in experts of test_dispatcher;
the lying one corrupts its RESULT. One test runs real worker processes of a tiny model through a
whole generation with a lying link in front of one of them.
"""

from __future__ import annotations

import pytest
import torch
from test_dispatcher import E, FakeWorker, _routing, answer, reference, tcp_dispatcher

from moeswarm.dispatch.spot_check import SpotCheckPolicy
from moeswarm.errors import WorkerError
from moeswarm.wire.config import CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch
from moeswarm.wire.stream import send_frame

ALL = list(range(E))


def lying(how: str, rate: float = 0.01, seed: int = 0):
    rng = torch.Generator().manual_seed(seed)

    def reply(worker, conn, frame):
        result = answer(Dispatch.from_frame(frame))
        outputs = result.outputs.clone()  # [n, d]
        if how == "zeros":
            outputs.zero_()
        else:
            rows = torch.rand(outputs.shape[0], generator=rng) < rate
            outputs[rows] += 1e-3 * torch.randn(outputs[rows].shape, generator=rng)
        result.outputs.copy_(outputs)
        send_frame(conn, result.to_frame(frame.request_id))

    return reply


@pytest.fixture
def holders():
    made = []

    def make(*behaviours):
        made.extend(FakeWorker(ALL, b) if b else FakeWorker(ALL) for b in behaviours)
        return made[-len(behaviours):]

    yield make
    for worker in made:
        worker.close()


def test_a_worker_returning_zeros_is_banned_and_never_reaches_the_output(holders):
    liar, a, b = holders(lying("zeros"), None, None)
    dispatcher = tcp_dispatcher([liar, a, b], spot_checks=SpotCheckPolicy(1.0, seed=1))
    for call in range(6):
        hidden, index, weights = _routing(6, 50 + call)
        out = dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights))
        assert torch.equal(out, reference(hidden, index, weights))  # every share checked: the lie is replaced
    assert [h.banned for h in dispatcher.holders] == [True, False, False]
    assert "failed a spot check at layer 0" in dispatcher.holders[0].cause
    assert dispatcher.stats.bans == 1 and dispatcher.stats.check_failures == 1
    dispatcher.close()


def test_noise_on_one_percent_of_rows_is_caught_at_five_percent_sampling(holders):
    liar, a, b = holders(lying("noise", 0.01, seed=3), None, None)
    dispatcher = tcp_dispatcher([liar, a, b], spot_checks=SpotCheckPolicy(0.05, seed=4))
    steps = 0
    while not dispatcher.holders[0].banned and steps < 200:
        steps += 1
        for layer in (0, 1):  # a step: every MoE layer once, 64 tokens (a batched decode step)
            hidden, index, weights = _routing(64, 1000 * steps + layer)
            dispatcher.combine(dispatcher.dispatch(layer, hidden, index, weights))
    assert dispatcher.holders[0].banned and steps < 200
    assert not dispatcher.holders[1].banned and not dispatcher.holders[2].banned
    dispatcher.close()


def test_honest_holders_are_never_banned_in_exact_and_lossy_modes(holders):
    a, b = holders(None, None)
    for wire in (WireConfig(), WireConfig(CombineMode.PARTIAL, "int8-b128", "int8-b128")):
        dispatcher = tcp_dispatcher([a, b], wire=wire, spot_checks=SpotCheckPolicy(1.0, seed=5))
        for call in range(10):
            hidden, index, weights = _routing(8, 60 + call)
            out = dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights))
            torch.testing.assert_close(out, reference(hidden, index, weights), rtol=0.05, atol=0.05)
        assert dispatcher.stats.checks >= 10 and dispatcher.stats.check_failures == 0 and dispatcher.stats.bans == 0
        dispatcher.close()


def test_two_holders_that_disagree_are_settled_by_the_backbone_not_both_banned(holders):
    """Two holders, one lies: the backbone computes the rows itself (the referee) and bans only the liar."""
    for liar_first in (True, False):
        liar, honest = holders(lying("zeros"), None)
        pair = [liar, honest] if liar_first else [honest, liar]
        dispatcher = tcp_dispatcher(pair, spot_checks=SpotCheckPolicy(1.0, seed=6), referee=answer)
        for call in range(4):
            hidden, index, weights = _routing(6, 70 + call)
            out = dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights))
            assert torch.equal(out, reference(hidden, index, weights))
        assert [h.banned for h in dispatcher.holders] == ([True, False] if liar_first else [False, True])
        assert dispatcher.stats.disputes_settled == 1 and dispatcher.stats.referee_computations == 1
        dispatcher.close()


def test_two_holders_that_disagree_with_nothing_to_settle_it_fail_the_call_banning_neither(holders):
    liar, honest = holders(lying("zeros"), None)
    dispatcher = tcp_dispatcher([liar, honest], spot_checks=SpotCheckPolicy(1.0, seed=6))
    hidden, index, weights = _routing(6, 70)
    with pytest.raises(WorkerError, match="no third holder or local copy of those experts can settle") as caught:
        dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    assert "\n" not in str(caught.value) and liar.address in str(caught.value) and honest.address in str(caught.value)
    assert [h.banned for h in dispatcher.holders] == [False, False]
    dispatcher.close()


def test_a_third_holder_settles_a_dispute_between_two(holders):
    liar, a, b = holders(lying("zeros"), None, None)
    dispatcher = tcp_dispatcher([liar, a, b], spot_checks=SpotCheckPolicy(1.0, seed=8))
    for call in range(6):
        hidden, index, weights = _routing(6, 80 + call)
        assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)),
                           reference(hidden, index, weights))
    assert [h.banned for h in dispatcher.holders] == [True, False, False]
    assert dispatcher.stats.referee_computations == 0
    dispatcher.close()


def huge_row(reply_worker, conn, frame):
    """Honest, except one row of every answer is 1e30 (finite)."""
    result = answer(Dispatch.from_frame(frame))
    result.outputs[0] = 1e30
    send_frame(conn, result.to_frame(frame.request_id))


@pytest.mark.parametrize("referee", [True, False])
def test_a_finite_but_absurd_row_is_caught_without_a_spot_check_and_never_reaches_the_output(holders, referee):
    """1e30 on one row passes the finite test; the norm gate catches it in the first call, a
    third computation confirms, the liar is banned and the call's output is the honest one."""
    liar, honest = holders(huge_row, None)
    dispatcher = tcp_dispatcher([liar, honest], referee=answer if referee else None)  # no spot checks at all
    for call in range(5):
        hidden, index, weights = _routing(6, 90 + call)
        out = dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights))
        assert torch.equal(out, reference(hidden, index, weights))
    assert dispatcher.holders[0].banned and "implausible RESULT" in dispatcher.holders[0].cause
    assert not dispatcher.holders[1].banned and dispatcher.stats.implausible == 1
    dispatcher.close()


def test_honest_answers_pass_the_norm_gate_over_many_calls(holders):
    a, b = holders(None, None)
    dispatcher = tcp_dispatcher([a, b], spot_checks=SpotCheckPolicy(0.2, seed=9), referee=answer)
    for call in range(60):
        hidden, index, weights = _routing(1 + call % 17, 200 + call)
        hidden = hidden * (0.1 + call % 7)  # inputs of varying scale
        dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights))
    assert dispatcher.stats.implausible == 0 and dispatcher.stats.bans == 0
    dispatcher.close()


def late_liar(after: int):
    """Honest for `after` dispatches, then zeros."""
    def reply(worker, conn, frame):
        result = answer(Dispatch.from_frame(frame))
        if worker.dispatches > after:
            result.outputs.zero_()
        send_frame(conn, result.to_frame(frame.request_id))
    return reply


def test_a_ban_reports_every_call_that_used_the_liars_unchecked_answers(holders):
    """The taint covers every call whose output the lie changed, and no call before the liar served."""
    liar, a, b = holders(late_liar(5), None, None)
    dispatcher = tcp_dispatcher([liar, a, b], spot_checks=SpotCheckPolicy(0.03, seed=11))
    wrong = []
    for call in range(1, 400):
        hidden, index, weights = _routing(4, 300 + call)
        out = dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights))
        if not torch.equal(out, reference(hidden, index, weights)):
            wrong.append(dispatcher.call_number)
        if dispatcher.holders[0].banned:
            break
    assert dispatcher.holders[0].banned and wrong
    (taint,) = dispatcher.take_taints()
    assert taint.holder == liar.address and dispatcher.take_taints() == []
    assert all(taint.hits(call, call) for call in wrong)
    assert taint.first <= wrong[0] and taint.runs[-1][1] < dispatcher.call_number  # the banning call was redone
    dispatcher.close()


def test_a_lying_link_to_a_real_worker_is_caught_in_a_generation(qwen2_moe, qwen2_replicas):
    """Real worker processes of the tiny model: one link lies (zeros); checks at 100 %: the
    generation stays bit-identical to local, the liar is banned, the honest links are not."""
    from moeswarm_bench.bench.lying import LyingLink
    from moeswarm.engine.generate import generate
    from moeswarm.sources.loading import load_local
    from moeswarm.swarm import open_swarm

    addresses = qwen2_replicas  # conftest's two workers holding every expert: the lie is the link's
    with open_swarm(
            qwen2_moe, [addresses[0], *addresses], spot_check=1.0, spot_check_seed=7,
            wrap_link=lambda i, link: LyingLink(link) if i == 0 else link) as swarm:
        result = generate(swarm, [72, 105, 33], 6, 0, load_local(qwen2_moe))
        assert result.bit_identical is True
        assert [s["banned"] for s in swarm.standing()] == [True, False, False]
        assert swarm.resilience()["bans"] == 1


def test_a_liar_answering_zeros_cannot_pull_the_statistics_down_onto_an_honest_holder(holders):
    """Zeros for 200 calls, unchecked: the layer's statistics must not fall so low that an honest
    answer looks implausible (and its holder is convicted on the liar's word)."""
    liar, honest = holders(lying("zeros"), None)
    dispatcher = tcp_dispatcher([liar, honest])
    for call in range(200):
        hidden, index, weights = _routing(3, 1000 + call)
        dispatcher.combine(dispatcher.dispatch(call % 2, hidden, index, weights))
    assert dispatcher.stats.implausible == 0 and [h.banned for h in dispatcher.holders] == [False, False]
    dispatcher.close()
