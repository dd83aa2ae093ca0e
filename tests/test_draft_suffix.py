"""Drafts that need no model (`--draft suffix`, generation/draft_suffix.py)."""

from __future__ import annotations

import pytest

from moeswarm_bench.bench.drafters import edited, replay
from moeswarm.bundled import TRAINED
from moeswarm.generation.draft_suffix import SuffixDrafter, SuffixHistory
from moeswarm.generation.drafters import NgramDrafter
from moeswarm.generation.request import GenerationRequest
from moeswarm.engine.generate import run_generation
from moeswarm.swarm import open_swarm


def test_the_longest_match_drafts_first_and_earns_its_length():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13
    context = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 6, 4, 2, 3]  # ends in "2 3": after "1 2 3" came 9; after "5 2 3" came 7
    drafter = SuffixDrafter()
    branches = drafter.branches(context, None, 8)
    assert branches[0][:1] == [7]  # the latest of the two-token matches first
    assert [9, 9, 5, 2] in branches  # the other two-token match: 2 x 2 tokens drafted
    longer = [5, 2, 3, 7, 8, 6, 4, 0, 5, 2, 3]  # "5 2 3" matched: 6 tokens earned
    assert SuffixDrafter().draft(longer, None, 8) == [7, 8, 6, 4, 0, 5]
    assert SuffixDrafter().draft([1, 2, 3], None, 8) == []  # nothing occurred before


def test_a_later_request_drafts_from_an_earlier_ones_output():
    history = SuffixHistory()
    first = SuffixDrafter(history)
    first.branches([10, 11, 12, 13, 14, 15, 16, 17], None, 4)  # registers the first request's context
    second = SuffixDrafter(history)
    assert second.branches([99, 12, 13, 14], None, 4) == [[15, 16, 17]]
    assert SuffixDrafter(history).draft([99, 12, 13, 14], None, 4) == []  # a sampled step: its own text only


TEXT = "def area(width, height):\n    total = width * height\n    return total\n\n" * 3


def test_an_edited_file_re_emitted_verifies_three_tokens_a_step_or_more():
    changed = edited(TEXT)
    assert changed is not None and "_new" in changed and "# edited" in changed
    tokens, steps = replay(SuffixDrafter(), list(TEXT.encode()), list(changed.encode()))
    assert tokens == len(changed.encode()) - 1 and tokens / steps >= 3.0


def test_a_file_an_earlier_request_wrote_drafts_a_later_request_that_only_names_it():
    history = SuffixHistory()
    replay(SuffixDrafter(history), list(b"write the file:\n"), list(TEXT.encode()))  # request 1 writes it
    prompt, output = list(b"again, with the width renamed:\n"), list(edited(TEXT).encode())
    suffix = replay(SuffixDrafter(history), prompt, output)
    ngram = replay(NgramDrafter(), prompt, output)  # sees only this request
    assert suffix[0] == ngram[0] and suffix[1] < ngram[1]


@pytest.fixture(scope="module")
def local_swarm_trained():
    with open_swarm(str(TRAINED), []) as swarm:
        yield swarm


def test_suffix_drafts_keep_the_greedy_output_bit_identical_and_replay_counts_the_steps(local_swarm_trained):
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return"
    plain = run_generation(local_swarm_trained, GenerationRequest(prompt, max_new_tokens=24)).result
    report = run_generation(local_swarm_trained, GenerationRequest(prompt, max_new_tokens=24, speculate=8,
                                                                   check_local=True, draft="suffix")).result
    assert report.bit_identical is True and report.tokens == plain.tokens
    assert report.steps < len(report.tokens) - 1  # drafts were accepted
    if report.finish_reason == "length":  # the bench's replay counts the same verify steps
        from moeswarm.sources.tokenizer import load_text_codec

        codec = load_text_codec(TRAINED, local_swarm_trained.model.config.vocab_size)
        assert replay(SuffixDrafter(), codec.encode(prompt), report.tokens)[1] == report.steps
