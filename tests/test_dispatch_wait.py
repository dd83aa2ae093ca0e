"""The wait policy (dispatch/wait.py): a decode layer call's replies spun for, or slept for, as the
intervals between calls show pays on this machine; a fake clock drives it."""

from __future__ import annotations

import pytest

from moeswarm.dispatch.wait import BLOCK, LONGEST_S, RETRY, SETTLE, SLEEP, SPIN, SPIN_S, TRIAL, WaitPolicy


def drive(policy: WaitPolicy, calls: int, step_s, now: float = 0.0) -> tuple[float, list[str]]:
    """`calls` decode layer calls, the i-th taking step_s(i, its mode) until the next one is sent:
    (the clock after, each call's mode)."""
    modes = []
    for i in range(calls):
        policy.observe(now)
        modes.append(policy.mode)
        assert policy.spin_s() == (SPIN_S if policy.mode == SPIN else 0.0)
        now += step_s(i, policy.mode)
    return now, modes


@pytest.mark.parametrize("sleep_s, spin_s, kept", [(0.004, 0.003, SPIN), (0.003, 0.004, SLEEP), (0.003, 0.003, SLEEP),
                                                   (0.003, 0.00296, SLEEP)])  # a tie, and under 2 %: asleep
def test_a_trial_keeps_the_faster_mode_and_sleeps_on_a_tie(sleep_s, spin_s, kept):
    policy = WaitPolicy()
    _, modes = drive(policy, 2 * TRIAL + 1, lambda i, mode: spin_s if mode == SPIN else sleep_s)
    assert modes[:-1].count(SPIN) == modes[:-1].count(SLEEP) == TRIAL  # the trial: both modes alike
    assert (policy.trials, policy.chosen, modes[-1]) == (1, kept, kept)  # the next call waits as chosen


def test_a_trial_s_modes_take_turns_in_blocks_over_every_layer_and_a_slow_last_layer_does_not_decide():
    """16 layers a step, the last one's interval 10x the others' (the head, the sampling): the modes
    take turns in blocks of BLOCK calls, each mode meets every layer, and with the same speed
    otherwise the trial keeps sleeping."""
    policy = WaitPolicy()
    _, modes = drive(policy, 2 * TRIAL + 1, lambda i, mode: 0.03 if i % 16 == 15 else 0.003)
    assert modes[:2 * BLOCK] == [SLEEP] * BLOCK + [SPIN] * BLOCK
    for mode in (SLEEP, SPIN):
        assert {i % 16 for i, m in enumerate(modes[:-1]) if m == mode} == set(range(16))
    assert policy.chosen == SLEEP
    drifting = WaitPolicy()  # the machine slows down steadily: alternating, spinning still shows 10 % faster
    drive(drifting, 2 * TRIAL + 1, lambda i, mode: (0.003 + 1e-5 * i) * (0.9 if mode == SPIN else 1.0))
    assert drifting.chosen == SPIN


def test_a_block_s_first_intervals_are_left_to_the_mode_before_it():
    """A halted core's cost outlasts the call that let it halt: the first SETTLE intervals of a block
    still show the other mode's, and are not counted for this one."""
    policy = WaitPolicy()
    state = {"last": SLEEP, "run": 0}

    def step(i, mode):  # the cost follows the mode of the block before for SETTLE calls
        state["run"] = state["run"] + 1 if mode == state["last"] else 1
        state["last"] = mode
        lagging = state["run"] <= SETTLE and i >= BLOCK
        shown = (SLEEP if mode == SPIN else SPIN) if lagging else mode
        return 0.003 if shown == SPIN else 0.0034

    drive(policy, 2 * TRIAL + 1, step)
    assert policy.chosen == SPIN
    assert len(policy._intervals[SPIN]) == len(policy._intervals[SLEEP]) == TRIAL - (TRIAL // BLOCK) * SETTLE


def test_pauses_between_steps_are_not_counted_and_a_new_trial_follows_retry_calls():
    policy = WaitPolicy()
    pauses = iter(range(10**6))
    # spinning is faster per call, but every 4th sleeping interval is a pause between requests
    now, _ = drive(policy, 2 * TRIAL + 1, lambda i, mode: LONGEST_S + 1 if mode == SLEEP and next(pauses) % 4 == 3
                   else {SLEEP: 0.004, SPIN: 0.003}[mode])
    assert policy.chosen == SPIN  # the pauses would have made sleeping look far worse: they were left out
    now, modes = drive(policy, RETRY - 1, lambda i, mode: 0.003, now)
    assert set(modes) == {SPIN} and policy.trials == 1
    now, modes = drive(policy, 2 * TRIAL + 1, lambda i, mode: {SLEEP: 0.002, SPIN: 0.005}[mode], now)
    assert SLEEP in modes[:-1] and SPIN in modes[:-1]  # a new trial: the machine may have changed
    assert (policy.trials, policy.chosen, modes[-1]) == (2, SLEEP, SLEEP)
