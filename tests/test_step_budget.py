"""engine/step_budget.py: a step's token budget grows to fill the wait on replies, within its floor and cap."""

from __future__ import annotations

import pytest

from moeswarm.engine.step_budget import StepBudget


def test_without_measurements_or_without_waits_the_budget_is_the_floor():
    budget = StepBudget(256, 2048)
    assert budget.tokens() == 256
    for _ in range(10):  # local mode: every second of a step is compute
        budget.record(100, 0.05, 0.0)
    assert budget.tokens() == 256


def test_the_budget_is_the_tokens_whose_compute_fills_the_wait():
    budget = StepBudget(256, 4096)
    budget.record(100, 0.5 + 0.1, 0.5)  # 1 ms per token computed, 0.5 s waited
    assert budget.tokens() == 500
    budget.record(100, 0.5 + 0.1, 0.5)
    assert budget.tokens() == 500  # the same step again: the same averages


def test_the_cap_and_the_floor_bound_it():
    budget = StepBudget(256, 1024)
    budget.record(10, 2.0 + 0.001, 2.0)  # 0.1 ms per token, 2 s waited: 20,000 tokens would fit
    assert budget.tokens() == 1024
    slow = StepBudget(256, 1024)
    slow.record(10, 0.1 + 1.0, 0.1)  # 100 ms per token, 0.1 s waited: 1 token would fit
    assert slow.tokens() == 256


def test_moving_averages_follow_a_change_of_link():
    budget = StepBudget(16, 100_000)
    budget.record(100, 0.1 + 0.48, 0.48)  # 1 ms per token, an 80 ms link's wait over 6 layers
    assert budget.tokens() == 480
    for _ in range(30):  # the link got faster: the wait shrinks, and with it the budget
        budget.record(100, 0.1 + 0.06, 0.06)
    assert budget.tokens() == 60


def test_empty_or_instant_steps_teach_nothing():
    budget = StepBudget(128, 1024)
    budget.record(0, 1.0, 0.5)
    budget.record(10, 0.0, 0.0)
    assert (budget.compute_per_token_s, budget.waiting_s, budget.tokens()) == (None, None, 128)


def test_a_token_costs_the_slope_of_compute_against_tokens_not_a_decode_step_s_average():
    """Decode steps of one token cost 13 ms each (the weights read once); a 256-token step costs
    120 ms: one more token costs (120 - 13) / 255 ms, not the 13 ms a decode step averages."""
    budget = StepBudget(256, 100_000)
    for _ in range(20):
        budget.record(1, 0.013 + 0.48, 0.48)
    assert budget.tokens() == 256  # 480 ms / 13 ms per token: 36, under the floor
    budget.record(256, 0.120 + 0.48, 0.48)
    assert budget.compute_per_token_s == pytest.approx(0.107 / 255)
    assert budget.tokens() == int(0.48 / (0.107 / 255))
