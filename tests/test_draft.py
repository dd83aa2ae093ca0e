"""`propose`: n-gram prompt lookup drafts, by hand."""

from __future__ import annotations

import pytest

from moeswarm.generation.draft import propose


def test_the_tokens_after_the_earlier_occurrence_of_the_last_trigram():
    assert propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]


def test_the_draft_stops_at_the_end_of_the_context():
    assert propose([1, 2, 3, 4, 1, 2, 3], 10) == [4, 1, 2, 3]
    assert propose([1, 1, 1, 1], 5) == [1]  # [1, 1, 1] at 0 is followed by the context's last token only


@pytest.mark.parametrize("max_draft, expected", [(1, [4]), (2, [4, 1]), (3, [4, 1, 2]), (4, [4, 1, 2, 3])])
def test_max_draft_caps_the_draft(max_draft, expected):
    assert propose([1, 2, 3, 4, 1, 2, 3], max_draft) == expected


def test_the_longest_ngram_wins_over_a_later_shorter_one():
    tokens = [5, 6, 7, 8, 9, 7, 10, 5, 6, 7]
    assert propose(tokens, 2) == [8, 9]  # [5, 6, 7] at 0, although [7] occurs later at 5
    assert propose(tokens, 2, max_ngram=2) == [8, 9]  # [6, 7] at 1
    assert propose(tokens, 2, max_ngram=1) == [10, 5]  # [7]: its latest earlier occurrence, at 5


def test_the_latest_occurrence_wins():
    assert propose([3, 1, 2, 8, 3, 1, 2, 9, 3, 1, 2], 2) == [9, 3]  # [3, 1, 2] at 0 and at 4: 4


def test_falls_back_to_shorter_ngrams():
    assert propose([1, 2, 3, 9, 2, 3], 3) == [9, 2, 3]  # no earlier [9, 2, 3]; the bigram [2, 3] at 1
    assert propose([4, 1, 2, 5, 3, 2], 2) == [5, 3]  # only the unigram [2] matches (at 2)


def test_no_match_no_draft():
    assert propose([1, 2, 3, 4], 4) == []
    assert propose([7], 4) == []
    assert propose([], 4) == []


@pytest.mark.parametrize("max_draft", [0, -1])
def test_no_room_no_draft(max_draft):
    assert propose([1, 2, 1, 2], max_draft) == []


def test_the_match_is_never_the_tail_itself():
    assert propose([7, 7], 3) == [7]  # the unigram at 0, followed by the last token
    assert propose([1, 2], 3) == []
