"""The wait policy (dispatch/wait.py): a decode layer call's replies slept for, dozed for or spun
for, as the intervals between calls show pays on this machine; a fake clock drives it."""

from __future__ import annotations

import pytest

from moeswarm.dispatch.wait import (BLOCK, DOZE, DOZE_MARGIN_S, LONGEST_S, MODES, RETRY, SETTLE, SLEEP, SPIN, SPIN_S, TRIAL,
                                    WaitPolicy, doze_s)

ALL = len(MODES) * TRIAL  # a trial's calls


def drive(policy: WaitPolicy, calls: int, step_s, now: float = 0.0) -> tuple[float, list[str]]:
    """`calls` decode layer calls, the i-th taking step_s(i, its mode) until the next one is sent:
    (the clock after, each call's mode)."""
    modes = []
    for i in range(calls):
        policy.observe(now)
        modes.append(policy.mode)
        assert policy.spin_s() == (0.0 if policy.mode == SLEEP else SPIN_S)
        assert policy.dozes == (policy.mode == DOZE)
        now += step_s(i, policy.mode)
    return now, modes


@pytest.mark.parametrize("sleep_s, doze_s_, spin_s, kept", [
    (0.004, 0.004, 0.003, SPIN), (0.003, 0.004, 0.004, SLEEP), (0.003, 0.003, 0.003, SLEEP),  # a tie: asleep
    (0.003, 0.00296, 0.00296, SLEEP),  # under 2 %: asleep
    (0.004, 0.003, 0.003, DOZE), (0.004, 0.003, 0.00296, DOZE),  # dozing as fast as spinning: less CPU
    (0.004, 0.0035, 0.003, SPIN)])
def test_a_trial_keeps_the_fastest_mode_and_the_one_of_less_cpu_on_a_tie(sleep_s, doze_s_, spin_s, kept):
    policy = WaitPolicy()
    step = {SLEEP: sleep_s, DOZE: doze_s_, SPIN: spin_s}
    _, modes = drive(policy, ALL + 1, lambda i, mode: step[mode])
    assert [modes[:-1].count(mode) for mode in MODES] == [TRIAL] * len(MODES)  # the trial: every mode alike
    assert (policy.trials, policy.chosen, modes[-1]) == (1, kept, kept)  # the next call waits as chosen


def test_a_dozing_call_sleeps_through_most_of_its_holder_s_median_round_trip():
    """doze_s: 70 % of the median after the send, at least DOZE_MARGIN_S before it, less what has
    passed; nothing while the holder is unmeasured."""
    assert doze_s(None, 0.0) == 0.0
    assert doze_s(0.004, 0.0) == pytest.approx(0.0028)
    assert doze_s(0.004, 0.001) == pytest.approx(0.0018)
    assert doze_s(0.0004, 0.0) == pytest.approx(0.0004 - DOZE_MARGIN_S)
    assert doze_s(0.004, 0.003) == doze_s(0.0001, 0.0) == 0.0


def test_a_trial_s_modes_take_turns_in_blocks_over_every_layer_and_a_slow_last_layer_does_not_decide():
    """16 layers a step, the last one's interval 10x the others' (the head, the sampling): the modes
    take turns in blocks of BLOCK calls, each mode meets every layer, and with the same speed
    otherwise the trial keeps sleeping."""
    policy = WaitPolicy()
    _, modes = drive(policy, ALL + 1, lambda i, mode: 0.03 if i % 16 == 15 else 0.003)
    assert modes[:3 * BLOCK] == [SLEEP] * BLOCK + [DOZE] * BLOCK + [SPIN] * BLOCK
    for mode in MODES:
        assert {i % 16 for i, m in enumerate(modes[:-1]) if m == mode} == set(range(16))
    assert policy.chosen == SLEEP
    drifting = WaitPolicy()  # the machine slows down steadily: alternating, spinning still shows 10 % faster
    drive(drifting, ALL + 1, lambda i, mode: (0.003 + 1e-5 * i) * (0.9 if mode == SPIN else 1.0))
    assert drifting.chosen == SPIN


def test_a_block_s_first_intervals_are_left_to_the_mode_before_it():
    """A halted core's cost outlasts the call that let it halt: the first SETTLE intervals of a block
    still show the other mode's, and are not counted for this one."""
    policy = WaitPolicy()
    cost = {SLEEP: 0.0034, DOZE: 0.0032, SPIN: 0.003}
    state = {"last": SLEEP, "before": SLEEP, "run": 0}

    def step(i, mode):  # the cost follows the mode of the block before for SETTLE calls
        if mode != state["last"]:
            state["before"], state["run"] = state["last"], 0
        state["run"] += 1
        state["last"] = mode
        lagging = state["run"] <= SETTLE and i >= BLOCK
        return cost[state["before"] if lagging else mode]

    drive(policy, ALL + 1, step)
    assert policy.chosen == SPIN
    assert [len(policy._intervals[mode]) for mode in MODES] == [TRIAL - (TRIAL // BLOCK) * SETTLE] * len(MODES)
    for mode in MODES:  # each interval its own mode's (the clock's sums: to a few ulps)
        assert max(abs(seen - cost[mode]) for seen in policy._intervals[mode]) < 1e-9


def test_pauses_between_steps_are_not_counted_and_a_new_trial_follows_retry_calls():
    policy = WaitPolicy()
    pauses = iter(range(10**6))
    # spinning is faster per call, but every 4th sleeping interval is a pause between requests
    now, _ = drive(policy, ALL + 1, lambda i, mode: LONGEST_S + 1 if mode == SLEEP and next(pauses) % 4 == 3
                   else {SLEEP: 0.004, DOZE: 0.0036, SPIN: 0.003}[mode])
    assert policy.chosen == SPIN  # the pauses would have made sleeping look far worse: they were left out
    now, modes = drive(policy, RETRY - 1, lambda i, mode: 0.003, now)
    assert set(modes) == {SPIN} and policy.trials == 1
    now, modes = drive(policy, ALL + 1, lambda i, mode: {SLEEP: 0.002, DOZE: 0.004, SPIN: 0.005}[mode], now)
    assert set(modes[:-1]) == set(MODES)  # a new trial: the machine may have changed
    assert (policy.trials, policy.chosen, modes[-1]) == (2, SLEEP, SLEEP)
