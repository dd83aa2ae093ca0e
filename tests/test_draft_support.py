"""A model-free draft's acceptance estimate per position (generation/draft_support.py) and its
calibration against what verify steps keep (generation/draft_measure.py's Calibration): pure numbers."""

from __future__ import annotations

import pytest

from moeswarm.generation.draft_measure import TRUST, Calibration
from moeswarm.generation.draft_suffix import Match, SuffixDrafter
from moeswarm.generation.draft_support import HALF_TRUST, support
from moeswarm.generation.drafters import NgramDrafter


def test_a_long_match_followed_once_is_trusted_at_every_position():
    estimates = support([Match(40, [7, 8, 9])], [7, 8, 9])
    assert estimates == pytest.approx([(40 + i) / (40 + i + HALF_TRUST[True]) for i in range(3)])
    assert min(estimates) > 0.97


def test_a_continuation_is_judged_by_its_frequency_among_the_strongest_occurrences():
    found = [Match(4, [1, 2]), Match(4, [1, 3]), Match(3, [5, 6]), Match(1, [1, 2])] + [Match(1, [9])] * 50
    # the tier: matched >= 2 tokens (half the longest); the 51 one-token matches do not vote
    e = support(found, [1, 2])
    assert e[0] == pytest.approx(2 / 3 * 4 / (4 + HALF_TRUST[True]))  # 2 of the 3 in the tier go on with 1
    assert e[1] == pytest.approx(1 / 2 * 5 / (5 + HALF_TRUST[True]))  # of those 2, one goes on with 2
    assert support(found, [5, 6, 4]) == pytest.approx([1 / 3 * 3 / 4, 4 / 5, 0.0])  # nothing reaches position 3
    assert support(found, [1], greedy=False) == pytest.approx([2 / 3 * 4 / (4 + HALF_TRUST[False])])
    assert support([], [1, 2]) == [0.0, 0.0] and support(found, []) == []


def test_one_token_matches_among_many_continuations_are_barely_trusted():
    found = [Match(1, [t]) for t in range(10)]
    assert support(found, [0]) == pytest.approx([0.1 / (1 + HALF_TRUST[True])])


def test_the_drafters_score_the_drafts_they_gave():
    context = [5, 2, 3, 7, 8, 6, 4, 0, 5, 2, 3]  # "5 2 3" matched once: 7 8 6 ... followed
    suffix = SuffixDrafter()
    draft = suffix.draft(context, None, 4)
    assert draft == [7, 8, 6, 4]
    assert suffix.support(context, [draft]) == [support([Match(3, [7, 8, 6, 4])], draft)]
    assert suffix.support(context, [[7, 9]])[0][1] == 0.0  # a token nothing followed with
    assert NgramDrafter().support(context, [draft]) == suffix.support(context, [draft])


def test_calibration_starts_from_the_estimate_and_learns_what_is_kept():
    c = Calibration()
    assert c.rates([0.05, 0.3, 0.95]) == pytest.approx([0.05, 0.3, 0.95])  # a fresh engine takes the drafter's word
    for _ in range(6):
        c.record([0.3, 0.3], 0)  # position 1 rejected, position 2 not tried
    assert c.rate(0.3) < 0.3 / 2 and c.rate(0.95) == pytest.approx(0.95)  # only that bucket learns
    for _ in range(3):
        c.record([0.75, 0.75, 0.75, 0.75], 4)  # all kept
    assert c.rate(0.75) > 0.75 + 0.1
    c.record([0.75, 0.55], 1)  # position 1 kept, position 2 rejected
    assert c.rate(0.55) == pytest.approx(TRUST * 0.55 / (1 + TRUST))
    c.record([], 0)
    c.record([0.2], 5)  # more kept than drafted: all of it
    assert c.kept[2] == c.tried[2] == 1.0
