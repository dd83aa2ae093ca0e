"""engine/scheduler.py's Scheduler: a step's plan is plain data, its budget and its groups decided in one place."""

from __future__ import annotations

import dataclasses

import pytest

from moeswarm.engine.scheduler import Feed, Scheduler, Slot, StepPlan


def test_the_plan_carries_the_budget_the_feeds_and_the_groups_of_about_equal_tokens():
    scheduler = Scheduler(prefill_chunk=8, step_tokens=32, max_batch=4, groups=2, packed=True)
    slots = [Slot(0, (3,)), Slot(20), Slot(0), Slot(5)]  # a decoder with 3 drafts, a long prompt, a decoder, a short prompt
    plan = scheduler.schedule(slots, [False] * 4, remote=True)
    # 4 + 1 decode tokens; the oldest prompt's chunk of 8; the 5-token prompt fits in the 19 left
    assert plan == StepPlan(budget=32, feeds=(Feed(4, 1), Feed(8, 1), Feed(1, 1), Feed(5, 1)),
                            groups=((1, 2), (0, 3)))  # 8 + 1 and 4 + 5 tokens: the heaviest first, each to the lightest
    assert plan.working == (0, 1, 2, 3) and plan.tokens == 18
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.budget = 64


def test_a_slot_sitting_out_is_in_no_group_and_a_scored_one_gets_a_forward_of_its_own():
    scheduler = Scheduler(prefill_chunk=16, step_tokens=20, max_batch=4, groups=2, packed=True)
    slots = [Slot(0), Slot(30), Slot(30), Slot(0)]
    plan = scheduler.schedule(slots, [False, True, False, False], remote=True)  # slot 1 asks for log-probabilities
    # 2 decode tokens, the oldest prompt's chunk of 16; the second prompt's chunk does not fit in the 2 left
    assert plan.feeds == (Feed(1, 1), Feed(16, 1), Feed(0, 0), Feed(1, 1))
    assert plan.working == (0, 1, 3)
    assert plan.groups == ((0, 3), (1,))
    unpacked = Scheduler(prefill_chunk=16, step_tokens=20, max_batch=4, groups=2, packed=False)
    assert unpacked.schedule(slots, [False] * 4, remote=True).groups == ((0, 1, 3),)  # one forward per sequence: one group


def test_the_measured_steps_grow_the_budget_and_choose_the_group_count():
    scheduler = Scheduler(prefill_chunk=8, step_tokens=8, max_batch=4, groups=0, packed=True)  # --groups 0: measured
    slots = [Slot(0, (7,)), Slot(0, (7,))]
    first = scheduler.schedule(slots, [False, False], remote=True)
    assert first == StepPlan(budget=8, feeds=(Feed(8, 1), Feed(8, 1)), groups=((0, 1),))  # one group tried first
    scheduler.learn(first, seconds=0.75, waiting_s=0.5, decoding=True)  # 0.25 s of compute for 16 tokens, 0.5 s waited
    second = scheduler.schedule(slots, [False, False], remote=True)
    assert second == StepPlan(budget=32, feeds=(Feed(8, 1), Feed(8, 1)), groups=((0,), (1,)))  # 0.5 / (0.25 / 16); two tried
    assert scheduler.group_policy.cost == {1: 0.75 / 16}
    assert scheduler.schedule(slots, [False, False], remote=False).groups == ((0, 1),)  # no trips: one group
    scheduler.learn(second, seconds=0.5, waiting_s=0.25, decoding=False)  # a prompt's step: the group count does not learn
    assert scheduler.group_policy.cost == {1: 0.75 / 16}
