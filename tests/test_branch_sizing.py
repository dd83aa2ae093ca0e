"""How the speculation hook (engine/speculation.py) sizes a greedy step's branches from given inputs:
which drafts it feeds, at what K, and what it learns from the tokens the model then emits. Plain
inputs (drafts, estimates, a fixed cost line, the sequence's acceptance EMA), no model: the numbers
are the star's at 5 ms on the held-out prompt of docs/bench-drafters.md, step 11."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moeswarm.engine.speculation import Speculation
from moeswarm.generation.draft_measure import ACCEPT_WEIGHT, DECAY, PRIOR
from moeswarm.generation.goodput import StepCost
from moeswarm.generation.sampling import SamplingParams

FAST = StepCost(0.04694, 0.002308, 0.000229)  # the star at 5 ms: a token costs 5 % of a one-token step
DRAFTS = [[14, 435], [2532, 1005], [448, 322]]  # three one-token matches, the drafter's order
ESTIMATES = [[0.05, 0.667]] * 3


class Scored:
    """A drafter that scores its drafts at fixed estimates."""

    name = "suffix"

    def support(self, context, drafts, greedy=True):
        return [list(ESTIMATES[DRAFTS.index(d)]) for d in drafts]


def _sized(measured: list[float], line: StepCost = FAST):
    """The hook after sizing DRAFTS under `line` for a greedy sequence whose first drafts kept `measured`
    per position."""
    speculation = Speculation(cap=8, adaptive=True)
    sequence = SimpleNamespace(branches=[list(d) for d in DRAFTS], drafter=Scored(), context=[1, 2, 3],
                               job=SimpleNamespace(params=SamplingParams()), max_drafts=8, k_limit=None, done=False)
    drafts = speculation.start(sequence)
    drafts.acceptance.values = list(measured)
    drafts.sizing = (line, 0)
    speculation.size(sequence, drafts)
    return speculation, sequence, drafts


def test_the_first_draft_is_fed_alone_where_its_rivals_rows_do_not_pay():
    """The first draft at its text's 0.18, its rivals at 0.05: one row at K = 2 (the rule that fed every
    branch chose K = 0 here). The dropped rivals are still judged against the emitted tokens."""
    speculation, sequence, drafts = _sized([0.18])
    assert (sequence.branches, sequence.k_limit, drafts.history) == ([[14, 435]], 2, [2])
    assert drafts.estimated == (3, DRAFTS, ESTIMATES)  # every draft cut to K = 2, to be judged

    sequence.context += [14, 1043]  # the model keeps 14, then says 1043 (not 435)
    speculation.after_step(sequence, drafts, 3, 1, 2, 1)
    # the EMA follows the first draft: position 1 kept, position 2 rejected
    assert drafts.acceptance.values == pytest.approx([0.18 + ACCEPT_WEIGHT * 0.82, PRIOR * (1 - ACCEPT_WEIGHT)])
    calibration = speculation.calibrations["suffix/greedy"]
    # position 1: 14 kept, then the dropped 2532 and 448 rejected (each outcome decays the bucket's counts)
    assert calibration.tried[0] == pytest.approx(1 + DECAY + DECAY ** 2)
    assert calibration.kept[0] == pytest.approx(DECAY ** 2)
    assert (calibration.tried[6], calibration.kept[6]) == (1.0, 0.0)  # 435 at 0.667: tried, rejected
    assert (speculation.totals.drafts, speculation.totals.drafted, speculation.totals.accepted) == (1, 2, 1)


def test_without_the_text_measured_no_draft_pays_and_the_shadow_teaches_the_first_draft_s_ema():
    """Never tried, the first draft is at its calibrated 0.05: K = 0, the drafts are shadows. The
    model then says 2532, 1005 (the second draft): the calibration counts it kept, the EMA (the first
    draft's) a rejection at position 1; the metrics count nothing (nothing was fed)."""
    speculation, sequence, drafts = _sized([])
    assert (sequence.branches, sequence.k_limit, drafts.history) == ([[]], 0, [0])
    assert drafts.shadow == (3, DRAFTS)
    sequence.context += [2532]
    speculation.after_step(sequence, drafts, 1, 1, 0, 0)
    assert drafts.shadow is not None  # 2532 does not settle the second draft yet
    sequence.context += [1005]
    speculation.after_step(sequence, drafts, 1, 1, 0, 0)
    assert drafts.shadow is None
    assert drafts.acceptance.values == pytest.approx([PRIOR * (1 - ACCEPT_WEIGHT)])
    calibration = speculation.calibrations["suffix/greedy"]
    assert calibration.kept[0] > 0 and calibration.kept[6] == 1.0  # 2532 and 1005 kept
    assert speculation.totals.drafts == 0


def test_a_draft_that_starts_another_is_not_fed_a_row_of_its_own():
    """The editing workload's step 10 (tests/test_goodput.py): the first draft is the start of the
    second; one row, the second's, at K = 5; the first is still judged (the EMA follows it)."""
    speculation = Speculation(cap=8, adaptive=True)
    found = [[288, 14, 1043, 12], [288, 14, 1043, 12, 288], [288, 14]]
    drafter = SimpleNamespace(name="suffix", support=lambda context, drafts, greedy=True: [[0.9] * len(d) for d in drafts])
    sequence = SimpleNamespace(branches=found, drafter=drafter, context=[1, 2, 3],
                               job=SimpleNamespace(params=SamplingParams()), max_drafts=8, k_limit=None, done=False)
    drafts = speculation.start(sequence)
    drafts.sizing = (FAST, 0)
    speculation.size(sequence, drafts)
    assert (sequence.branches, sequence.k_limit) == ([[288, 14, 1043, 12, 288]], 5)
    assert drafts.estimated[1][0] == [288, 14, 1043, 12]
    sequence.context += [288, 14, 1043, 12, 288, 14]
    speculation.after_step(sequence, drafts, 6, 1, 5, 5)
    assert drafts.acceptance.values == pytest.approx([PRIOR + ACCEPT_WEIGHT * (1 - PRIOR)] * 4)  # the first's 4 kept
    assert speculation.totals.accepted == 5


def test_a_slow_link_feeds_every_branch():
    """The same drafts behind a 50 ms link (a row nearly free): all three rows at K = 2."""
    _, sequence, _ = _sized([0.18], StepCost(0.330, 0.002308, 0.000229))
    assert (sequence.branches, sequence.k_limit) == (DRAFTS, 2)
