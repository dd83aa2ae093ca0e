"""What serve's sampling options do to logits: min_p, the penalties, logit_bias, top log-probabilities."""

from __future__ import annotations

import pytest
import torch

from moeswarm.generation.sampling import SamplingParams, biased, log_probs, penalize, probabilities, top_logprobs

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])  # [V = 5]


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_top_one():
    plain = probabilities(LOGITS, SamplingParams(temperature=1.0))
    kept = probabilities(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    survivors = plain >= 0.3 * plain.max()
    assert torch.equal(kept > 0, survivors) and survivors.sum() == 2
    assert torch.allclose(kept[survivors], plain[survivors] / plain[survivors].sum())


def test_penalties_count_what_they_should():
    context, output_count = [0, 3, 1, 1], 2  # prompt [0, 3], output [1, 1]
    got = penalize(LOGITS, context, output_count, SamplingParams(repetition_penalty=2.0))
    assert got.tolist() == [1.0, 0.5, 0.0, -2.0, -3.0]  # seen: positive halved, negative doubled (prompt included)
    got = penalize(LOGITS, context, output_count, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert got.tolist() == [2.0, 1.0 - 0.5 - 2 * 0.25, 0.0, -1.0, -3.0]  # the output's tokens only
    assert penalize(LOGITS, context, output_count, SamplingParams()) is LOGITS
    assert SamplingParams(frequency_penalty=0.1).penalised and not SamplingParams(min_p=0.5).penalised


def test_logit_bias_adds_at_every_position():
    rows = torch.stack([LOGITS, LOGITS])  # [2, V]
    got = biased(rows, SamplingParams(logit_bias=((4, 100.0), (0, -100.0))))
    assert got[:, 4].tolist() == [97.0, 97.0] and got[:, 0].tolist() == [-98.0, -98.0]
    assert torch.equal(got[:, 1:4], rows[:, 1:4])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


def test_top_logprobs_are_the_log_softmax_likeliest_first():
    row = log_probs(LOGITS)
    chosen, top = top_logprobs(row, 2, 3)
    assert chosen == float(torch.log_softmax(LOGITS, -1)[2])
    assert [token for token, _ in top] == [0, 1, 2] and [value for _, value in top] == row[:3].tolist()
    assert top_logprobs(row, 4, 0) == (float(row[4]), ())
