"""The goodput rule (generation/goodput.py) and what feeds it (generation/draft_measure.py): pure numbers.

choose_k is checked against a brute force that knows nothing of the closed form: each outcome of a
K-draft step (first rejection at position j, or all kept) enumerated with its probability.
"""

from __future__ import annotations

import itertools
import random

import pytest

from moeswarm.generation.draft_measure import MIN_STEPS, MIN_TOKEN_SHARE, PRIOR, Acceptance, CostModel
from moeswarm.generation.goodput import (DRAFT_MARGIN, StepCost, branch_acceptance, choose_branches, choose_k,
                                        expected_tokens, goodput, own_rows)


def brute_tokens(acceptance: list[float], k: int) -> float:
    """E[tokens] of a K-draft step, by enumerating where the first rejection falls."""
    total = 0.0
    for first_rejected in range(k + 1):  # k: every draft kept
        p = 1.0
        for i in range(first_rejected):
            p *= acceptance[i]
        if first_rejected < k:
            p *= 1 - acceptance[first_rejected]
        total += p * (first_rejected + 1)  # the kept drafts and the step's own token
    return total


def brute_k(acceptance: list[float], cost: StepCost, cap: int, rows: int, base: int, margin: float) -> int:
    rates = {k: brute_tokens(acceptance, k) / cost.seconds(base + (rows * (1 + k) if k else 1), k > 0)
             for k in range(cap + 1)}
    drafting = {k: rate for k, rate in rates.items() if k > 0}
    if not drafting or max(drafting.values()) <= rates[0] * (1 + margin) * (1 + 1e-9):
        return 0
    best = max(drafting.values())
    return min(k for k, rate in drafting.items() if rate >= best * (1 - 1e-9))


def test_expected_tokens_is_the_enumerated_expectation():
    for acceptance in ([0.0] * 4, [1.0] * 4, [0.9, 0.5, 0.2, 0.7], [0.3, 1.0, 0.0, 1.0]):
        for k in range(5):
            assert expected_tokens(acceptance, k) == pytest.approx(brute_tokens(acceptance, k), abs=1e-12)
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0 and expected_tokens([0.0, 1.0], 2) == 1.0


def test_choose_k_matches_brute_force_over_random_inputs():
    pick = random.Random(58)
    for _ in range(2000):
        cap = pick.randrange(0, 9)
        acceptance = [pick.choice([0.0, 1.0, pick.random()]) for _ in range(cap)]
        cost = StepCost(pick.choice([0.0, pick.random()]) + 1e-6, pick.random() * pick.choice([1e-4, 1e-2, 1.0]),
                        pick.choice([0.0, pick.random() * 0.05]))
        rows, base = pick.randrange(1, 4), pick.randrange(0, 20)
        margin = pick.choice([0.0, DRAFT_MARGIN, pick.random() * 0.2])
        assert choose_k(acceptance, cost, cap, rows, base, margin) == brute_k(acceptance, cost, cap, rows, base, margin)


def test_a_wan_step_drafts_where_a_local_step_does_not():
    acceptance = [0.6, 0.5, 0.5, 0.4]
    wan = StepCost(fixed_s=0.080, per_token_s=0.001)  # 80 ms of trips, 1 ms a token
    local = StepCost(fixed_s=0.002, per_token_s=0.010)  # compute-bound: each row costs as much as a step
    assert choose_k(acceptance, wan, 4) == 4
    assert choose_k(acceptance, local, 4) == 0


def test_no_acceptance_or_no_cap_means_no_drafts():
    cheap = StepCost(0.1, 1e-6)
    assert choose_k([0.0] * 8, cheap, 8) == 0  # drafts that are never kept only cost
    assert choose_k([1.0] * 8, cheap, 0) == 0  # --speculate 0: off
    assert choose_k([0.9] * 8, StepCost(0.1, 1e-6, draft_s=1.0), 8) == 0  # drafting slower than it saves


def test_break_even_is_where_the_issue_puts_it():
    """Without a margin, one draft pays when a_1 > per_token / (fixed + per_token): the extra row's
    share of a step. With it, when (1 + a_1) / (fixed + 2 per_token) > (1 + margin) / (fixed + per_token)."""
    cost = StepCost(fixed_s=0.080, per_token_s=0.016)  # a row is a sixth of a one-token step of 96 ms
    edge = 0.016 / 0.096
    assert choose_k([edge * 1.01], cost, 1, margin=0.0) == 1 and choose_k([edge * 0.99], cost, 1, margin=0.0) == 0
    edge = (1 + DRAFT_MARGIN) * 0.112 / 0.096 - 1
    assert choose_k([edge * 1.01], cost, 1) == 1 and choose_k([edge * 0.99], cost, 1) == 0


def test_a_gain_inside_the_margin_does_not_draft():
    """Drafts never kept, or kept too rarely to pay for being wrong, leave K at 0; a clear gain drafts."""
    wan = StepCost(fixed_s=0.050, per_token_s=0.0005)
    assert choose_k([0.04] * 8, wan, 8) == 0  # about 3 % more tokens a step: inside the margin
    assert choose_k([0.04] * 8, wan, 8, margin=0.0) >= 1
    assert choose_k([0.6] * 8, wan, 8) >= 4


def test_acceptance_ema_per_position():
    a = Acceptance()
    assert a.rates(3) == [PRIOR] * 3
    a.record(drafted=4, accepted=2)  # positions 1, 2 kept, 3 rejected, 4 not tried
    r = a.rates(4)
    assert r[0] > PRIOR and r[1] > PRIOR and r[2] < PRIOR and r[3] == PRIOR
    assert (a.drafts, a.drafted, a.accepted, a.accepted_at) == (1, 4, 2, [1, 1])
    for _ in range(12):
        a.record(drafted=3, accepted=0)
    assert a.rates(1)[0] < 0.05  # a dozen rejections bring position 1 down
    a.record(0, 0)  # nothing drafted: nothing learnt
    assert a.drafts == 13


def test_cost_model_fits_a_line_and_floors_its_slope():
    model = CostModel()
    assert not model.measured
    for _ in range(MIN_STEPS):
        for tokens, seconds in ((1, 0.100), (3, 0.104), (5, 0.108)):
            model.record(tokens, seconds)
    line = model.line()
    assert line.fixed_s == pytest.approx(0.098) and line.per_token_s == pytest.approx(0.002)
    flat = CostModel()
    flat.record(1, 0.05)  # one count seen: the slope is the floor
    assert flat.line().per_token_s == pytest.approx(MIN_TOKEN_SHARE * 0.05)
    assert flat.line().seconds(1, False) == pytest.approx(0.05)
    noisy = CostModel()
    for _ in range(MIN_STEPS):
        noisy.record(1, 0.05)
        noisy.record(4, 0.04)  # a faster bigger step (noise): never a negative slope
    assert noisy.line().per_token_s > 0


def test_one_slow_step_at_a_count_does_not_make_rows_dear():
    """A count enters the line once measured MIN_STEPS times, at the median of its latest steps: the
    first 9-token step of a sequence, slow (a new shape, a load spike), does not set the slope and turn
    drafting off for good (at K = 0 the count would never be measured again)."""
    model = CostModel()
    for seconds in (0.031, 0.029, 0.030, 0.030):
        model.record(1, seconds)
    model.record(9, 0.120)  # one slow step
    assert model.line().per_token_s == pytest.approx(MIN_TOKEN_SHARE * 0.030 / 1.0, rel=0.02)  # the floor
    model.record(9, 0.048)
    model.record(9, 0.047)  # the median of 0.120, 0.048, 0.047
    line = model.line()
    assert line.per_token_s == pytest.approx((0.048 - 0.030) / 8, rel=1e-6)
    assert line.seconds(1, False) == pytest.approx(0.030)
    # three one-token-matched branches (generation/branches.py) each kept at 0.17, as step sizes them:
    rates, rows = branch_acceptance([[1, 4], [2, 5], [3, 6]], [[0.17, 0.67]] * 3)
    assert choose_k(rates, line, 8, rows) == 2
    outlier = StepCost(0.030 - 0.090 / 8, 0.090 / 8)  # the line through the slow step and the one-token steps
    assert choose_k(rates, outlier, 8, rows) == 0


def test_branches_verified_side_by_side_are_one_step_whose_run_is_the_longest_kept():
    """The greedy token at each position is one token: distinct prefixes are exclusive, so their
    chances add; a shared prefix counts once."""
    rates, rows = branch_acceptance([[1, 4], [2, 5], [3, 6]], [[0.17, 0.67]] * 3)
    assert rates == pytest.approx([0.51, 0.67]) and rows == [3, 3]
    drafts = [[1, 2, 3], [1, 2, 4], [1, 7], [5]]
    given = [[0.6, 0.5, 0.4], [0.6, 0.5, 0.3], [0.6, 0.2], [0.3]]
    rates, rows = branch_acceptance(drafts, given)  # [1, 7]'s own 0.6 is [1, 2, 3]'s: the first branch's is read
    reach = [0.6 + 0.3, 0.6 * (0.5 + 0.2), 0.6 * 0.5 * (0.4 + 0.3)]  # P(the kept run reaches position i)
    assert rates == pytest.approx([reach[0], reach[1] / reach[0], reach[2] / reach[1]])
    assert rows == [2, 3, 4]  # the drafts cut to K: distinct ones
    assert expected_tokens(rates, 3) == pytest.approx(1 + sum(reach))
    rates_one, rows_one = branch_acceptance([[1, 2]], [[0.3, 0.9]])
    assert rates_one == pytest.approx([0.3, 0.9]) and rows_one == [1, 1]  # one draft: its own rates
    assert branch_acceptance([[1], [2]], [[0.8], [0.7]])[0] == [1.0]  # estimates that overpromise: capped
    # a cut that merges branches costs fewer rows: K = 1 here feeds 2 rows, not 4
    cost = StepCost(0.010, 0.002)
    assert choose_k(rates, cost, 1, rows) == 1 and choose_k(rates, cost, 1, 4) == 0


def brute_branch_tokens(drafts: list[list[int]], rates: list[list[float]], k: int) -> float:
    """E[tokens] of a step feeding `drafts` cut to K, by walking the model's token at each position:
    each fed continuation of the kept run so far with its draft's rate (the first draft carrying
    that prefix), anything else (the run ends) with the rest."""
    def walk(prefix: tuple[int, ...]) -> float:
        if len(prefix) == k:
            return 0.0
        chances: dict[int, float] = {}
        for draft, rate in zip(drafts, rates):
            if len(draft) > len(prefix) and tuple(draft[:len(prefix)]) == prefix:
                chances.setdefault(draft[len(prefix)], rate[len(prefix)])
        return sum(p * (1 + walk(prefix + (token,))) for token, p in chances.items())
    return 1.0 + walk(())


def brute_branches(drafts, rates, cost: StepCost, cap: int, margin: float) -> tuple[int, int]:
    values = {}
    for n in range(1, len(drafts) + 1):
        for k in range(1, cap + 1):
            cut = {tuple(d[:k]) for d in drafts[:n]}
            rows = sum(1 for d in cut if not any(len(o) > len(d) and o[:len(d)] == d for o in cut))
            values[n, k] = brute_branch_tokens(drafts[:n], rates[:n], k) / cost.seconds(rows * (1 + k), True)
    best = max(values.values())
    if best <= (1 + margin) / cost.seconds(1, False) * (1 + 1e-9):
        return 0, 0
    return min(nk for nk, value in values.items() if value >= best * (1 - 1e-9))


def test_choose_branches_matches_brute_force_over_random_inputs():
    rng = random.Random(58)
    for _ in range(300):
        drafts = [[rng.randint(1, 3) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
        rates = [[rng.choice([0.0, 0.05, 0.1, 0.2, 0.3]) for _ in d] for d in drafts]  # a prefix's rivals sum <= 0.9
        cost = StepCost(rng.uniform(0.005, 0.3), rng.uniform(0.0002, 0.01), rng.choice([0.0, 0.0005]))
        for margin in (0.0, DRAFT_MARGIN):
            assert choose_branches(drafts, rates, cost, 3, margin=margin) == brute_branches(drafts, rates, cost, 3, margin)


def test_a_rival_branch_is_fed_only_where_its_row_pays():
    """The star at 5 ms in docs/bench-drafters.md, held-out prompt, step 11: three one-token matches,
    the first draft at its text's measured 0.18, its rivals calibrated at 0.05. There a token costs 5 %
    of a one-token step (fixed 46.9 ms, 2.3 ms a token): feeding all three rows never pays (the rule
    that fed every branch chose K = 0, and the first draft's 14 was the model's token); the first alone
    at K = 2 does. Behind a 50 ms link the same rows are nearly free and all three are fed."""
    drafts = [[14, 435], [2532, 1005], [448, 322]]
    rates = [[0.18, 0.667], [0.05, 0.667], [0.05, 0.667]]
    fast = StepCost(0.04694, 0.002308, 0.000229)
    # the rule that fed every branch read the step as one: the three calibrated at 0.048 each, lifted
    # to the text's 0.18; no K paid for three rows
    assert choose_k([0.18, 0.667], fast, 8, [3, 3]) == 0
    assert choose_branches(drafts, rates, fast, 8) == (1, 2)
    every, rows = branch_acceptance(drafts, rates)
    one, one_rows = branch_acceptance(drafts[:1], rates[:1])
    assert goodput(one, fast, 2, one_rows) > goodput(every, fast, 2, rows) * 1.1
    slow = StepCost(0.330, 0.002308, 0.000229)
    assert choose_branches(drafts, rates, slow, 8) == (3, 2)
    assert choose_branches(drafts, [[0.0, 0.0]] * 3, slow, 8) == (0, 0)  # nothing kept: plain decoding


def test_a_draft_that_starts_another_rides_in_its_row():
    """The star at 5 ms in docs/bench-drafters.md, editing workload, step 10: the drafter's first draft
    is the start of its second, one token longer. Counted as two rows, the fifth token cost a second
    row and the step stopped at K = 4; the second draft's row verifies the first's tokens too, so one
    row at K = 5."""
    assert own_rows([[1, 2], [1, 2, 3], [1], [4], [1, 2]]) == [[1, 2, 3], [4]]
    drafts = [[288, 14, 1043, 12], [288, 14, 1043, 12, 288], [288, 14]]
    rates = [[0.9, 0.909, 0.917, 0.923], [0.9, 0.909, 0.917, 0.923, 0.9], [0.9, 0.909]]
    assert branch_acceptance(drafts, rates)[1] == [1, 1, 1, 1, 1]
    assert choose_branches(drafts, rates, StepCost(0.0469, 0.0023, 0.0002), 8) == (2, 5)


def test_cost_model_ignores_nonsense_and_stays_bounded():
    model = CostModel()
    model.record(0, 1.0)
    model.record(2, float("nan"))
    model.record(2, -1.0)
    assert not model.measured
    for tokens in range(1, 1000):
        model.record(tokens, 0.01)
    assert len(model.by_tokens) == 256


@pytest.mark.parametrize("cap", [1, 4, 8])
def test_k_falls_to_zero_after_rejections_and_returns_with_acceptance(cap):
    a, cost = Acceptance(), StepCost(0.020, 0.0005)
    chosen = []
    for _ in range(30):
        k = choose_k(a.rates(cap), cost, cap)
        chosen.append(k)
        a.record(max(k, 1), 0)  # (a shadow draft when K is 0)
    assert chosen[0] >= 1 and chosen[-1] == 0 and chosen.index(0) <= 12
    for _ in range(10):
        a.record(cap, cap)
    assert choose_k(a.rates(cap), cost, cap) == cap


def test_brute_force_agrees_on_every_small_grid_point():
    grid = [0.0, 0.25, 0.5, 0.9, 1.0]
    cost = StepCost(0.05, 0.004)
    for acceptance in itertools.product(grid, repeat=3):
        for margin in (0.0, DRAFT_MARGIN):
            assert choose_k(list(acceptance), cost, 3, margin=margin) == brute_k(list(acceptance), cost, 3, 1, 0, margin)
