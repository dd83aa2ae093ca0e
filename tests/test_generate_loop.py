"""`generate` with a fake stepper: greedy, sampled, speculative, eos, stops, limits, the check against a reference.

The fake model knows one sequence SEQ: after a context equal to SEQ's first n tokens it predicts
SEQ[n]; after any other context it predicts WRONG. A rejected draft left in its context (a missed
`crop`) would therefore show up as WRONG tokens in the output.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from test_sampling import assert_matches  # chi-square (scipy) and a total-variation bound

from moeswarm.gate import GateConfig
from moeswarm.generation.loop import generate
from moeswarm.generation.sampling import SamplingParams, make_generator, probabilities

SEQ = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2, 3, 4]
PROMPT = SEQ[:6]  # [1, 2, 3, 4, 1, 2]
VOCAB = 12
WRONG = 9


class FakeStepper:
    """The Stepper interface: forward(tokens) -> logits [n, V] float32, crop(length), length (no branches)."""

    branchable = False

    def __init__(self, sequence: list[int] = SEQ, perturb: dict[int, tuple[int, float]] | None = None):
        self.sequence = sequence
        self.context: list[int] = []
        self.feeds: list[list[int]] = []
        self.crops: list[int] = []
        self.perturb = perturb or {}  # forward call number -> (vocab index, value added to its last row)

    @property
    def length(self) -> int:
        return len(self.context)

    def forward(self, tokens: list[int]) -> torch.Tensor:
        self.feeds.append(list(tokens))
        logits = torch.zeros(len(tokens), VOCAB)  # [n, V]
        for row, token in enumerate(tokens):
            self.context.append(token)
            logits[row, self._next(self.context)] = 1.0
        if len(self.feeds) in self.perturb:
            column, value = self.perturb[len(self.feeds)]
            logits[-1, column] += value
        return logits

    def crop(self, length: int) -> None:
        self.crops.append(length)
        del self.context[length:]

    def _next(self, context: list[int]) -> int:
        n = len(context)
        return self.sequence[n] if n < len(self.sequence) and context == self.sequence[:n] else WRONG


def test_greedy_follows_the_model():
    model = FakeStepper()
    result = generate(model, PROMPT, 8)

    assert result.tokens == SEQ[6:14] == [3, 5, 1, 2, 3, 4, 1, 2]
    assert (result.steps, result.drafted, result.accepted) == (7, 0, 0)
    assert model.feeds == [PROMPT, [3], [5], [1], [2], [3], [4], [1]]
    assert model.crops == [7, 8, 9, 10, 11, 12, 13]
    assert result.prompt_tokens == PROMPT
    assert (result.bit_identical, result.tokens_match, result.first_mismatch, result.max_abs_diff) == (None, None, None, 0.0)


def test_speculation_keeps_the_greedy_tokens_with_counts_by_hand():
    # step 1: draft [4, 1, 2] after trigram [1, 2, 3]; the model says 5: none accepted
    # step 2: no n-gram of [..., 3, 5] occurred before: no draft
    # step 3: draft [2, 3, 5] after unigram [1]; the model says 2, 3, 4: two accepted
    # step 4: one token of room left: draft [1] after trigram [2, 3, 4]; accepted
    model = FakeStepper()
    result = generate(model, PROMPT, 8, speculate=3)

    assert result.tokens == [3, 5, 1, 2, 3, 4, 1, 2]
    assert (result.steps, result.drafted, result.accepted) == (4, 7, 3)
    assert model.feeds == [PROMPT, [3, 4, 1, 2], [5], [1, 2, 3, 5], [4, 1]]
    assert model.crops == [7, 8, 11, 13]  # rejected drafts rolled back
    assert model.context == SEQ[:13]


def test_a_periodic_sequence_accepts_every_draft():
    cycle = [0, 1, 2, 3] * 4
    model = FakeStepper(cycle)
    result = generate(model, cycle[:5], 8, speculate=3)

    assert result.tokens == cycle[5:13] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert (result.steps, result.drafted, result.accepted) == (2, 5, 5)
    assert model.feeds == [cycle[:5], [1, 2, 3, 0], [1, 2, 3]]


@pytest.mark.parametrize("speculate", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 8, 10])
def test_max_new_tokens_is_exact_and_speculation_changes_nothing(max_new_tokens, speculate):
    model = FakeStepper()
    result = generate(model, PROMPT, max_new_tokens, speculate)

    assert result.tokens == SEQ[6 : 6 + max_new_tokens]
    assert len(result.tokens) == 1 + result.steps + result.accepted  # prefill's token, one per step, accepted drafts
    assert len(model.feeds) == 1 + result.steps
    assert sum(map(len, model.feeds)) == len(PROMPT) + result.steps + result.drafted
    assert all(len(feed) <= 1 + speculate for feed in model.feeds[1:])


def test_one_new_token_is_the_prefill_alone():
    model = FakeStepper()
    result = generate(model, PROMPT, 1, speculate=4)
    assert result.tokens == [3] and result.steps == 0 and model.feeds == [PROMPT] and model.crops == []


def test_eos_stops_generation():
    result = generate(FakeStepper(), PROMPT, 8, eos_token_id=4)
    assert result.tokens == [3, 5, 1, 2, 3, 4] and result.steps == 5


def test_eos_stops_speculation_and_is_never_accepted_as_a_draft():
    model = FakeStepper()
    result = generate(model, PROMPT, 8, speculate=3, eos_token_id=2)

    # step 3 drafts [2, 3, 5]: the model agrees on 2, but 2 is eos, so it comes as the step's own token
    assert result.tokens == [3, 5, 1, 2]
    assert (result.steps, result.drafted, result.accepted) == (3, 6, 0)
    assert model.feeds == [PROMPT, [3, 4, 1, 2], [5], [1, 2, 3, 5]]


def test_eos_from_the_prefill():
    result = generate(FakeStepper(), PROMPT, 8, speculate=3, eos_token_id=3)
    assert result.tokens == [3] and result.steps == 0


def test_on_tokens_gets_every_token_in_order():
    calls: list[list[int]] = []
    result = generate(FakeStepper(), PROMPT, 8, speculate=3, on_tokens=calls.append)

    assert calls == [[3], [5], [1], [2, 3], [4], [1], [2]]  # [2, 3] and [1]: accepted drafts
    assert [t for call in calls for t in call] == result.tokens


def test_a_reference_equal_to_the_model_is_bit_identical():
    model, reference = FakeStepper(), FakeStepper()
    result = generate(model, PROMPT, 8, speculate=3, reference=reference)

    assert (result.bit_identical, result.tokens_match, result.first_mismatch, result.max_abs_diff) == (True, True, None, 0.0)
    assert reference.feeds == model.feeds and reference.crops == model.crops  # the reference saw the same forwards


def test_a_reference_that_differs_at_one_step_is_named():
    # forward call 3 is step 2; 0.25 on a non-argmax logit changes the bits, not the token
    result = generate(FakeStepper(), PROMPT, 8, reference=FakeStepper(perturb={3: (0, 0.25)}))

    assert result.tokens == SEQ[6:14]  # the model's tokens, not the reference's
    assert (result.bit_identical, result.tokens_match) == (False, True)
    assert result.first_mismatch == "logits differ at step 2"
    assert result.max_abs_diff == 0.25


def test_the_first_mismatch_is_kept_and_the_largest_difference_reported():
    reference = FakeStepper(perturb={1: (0, 0.125), 4: (7, 0.5)})
    result = generate(FakeStepper(), PROMPT, 8, reference=reference)

    assert (result.bit_identical, result.tokens_match) == (False, True)
    assert result.first_mismatch == "logits differ at prefill"
    assert result.max_abs_diff == 0.5


def test_a_reference_with_another_argmax_does_not_match_tokens():
    result = generate(FakeStepper(), PROMPT, 8, reference=FakeStepper(perturb={5: (WRONG, 2.0)}))

    assert result.tokens == SEQ[6:14]
    assert (result.bit_identical, result.tokens_match) == (False, False)
    assert result.first_mismatch == "logits differ at step 4"
    assert result.max_abs_diff == 2.0


def test_an_empty_prompt_is_refused_before_any_forward():
    model = FakeStepper()
    with pytest.raises(ValueError) as caught:
        generate(model, [], 8)
    assert str(caught.value) == "empty prompt: give at least one token"
    assert model.feeds == []


# --- sampling -------------------------------------------------------------------------------------

MARKOV = torch.tensor([
    [0.2, 2.0, 0.5, -1.0],
    [0.0, 0.3, 1.8, 0.6],
    [1.0, 0.0, 0.4, 1.5],
    [2.2, 0.8, -0.5, 0.1],
])  # [4, 4]: row t = logits of the token after t
CYCLE = [0, 1, 2, 3, 0, 1]  # a prompt whose n-grams give drafts at most steps
SAMPLED = SamplingParams(temperature=0.8, top_k=3)


class MarkovStepper(FakeStepper):
    """Logits after each token are MARKOV's row for that token: a model with a real distribution."""

    def forward(self, tokens: list[int]) -> torch.Tensor:
        self.feeds.append(list(tokens))
        self.context += tokens
        return MARKOV[tokens].clone()  # [n, 4]


def test_sampled_generation_with_or_without_speculation_follows_the_model():
    """The joint law of three sampled tokens is the chain's, speculating or not (chi-square, fixed seed)."""
    law = probabilities(MARKOV, SAMPLED).double()  # [4, 4]
    expected = {(a, b, c): float(law[CYCLE[-1], a] * law[a, b] * law[b, c]) for a in range(4) for b in range(4) for c in range(4)}
    runs = 1500
    for speculate in (0, 3):
        generator = make_generator(21 + speculate)
        counts, drafted = Counter(), 0
        for _ in range(runs):
            result = generate(MarkovStepper(), CYCLE, 3, speculate, sampling=SAMPLED, generator=generator)
            counts[tuple(result.tokens)] += 1
            drafted += result.drafted
        assert (drafted > runs // 2) if speculate else (drafted == 0)  # speculation really ran (or really did not)
        assert_matches(counts, expected, runs)  # top-k's zeros never appear, the rest in proportion


def test_sampling_with_a_seed_is_reproducible():
    def tokens(seed: int, speculate: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        return generate(MarkovStepper(), CYCLE, 24, speculate, sampling=params).tokens

    assert tokens(3, 0) == tokens(3, 0) and tokens(3, 4) == tokens(3, 4)
    assert tokens(3, 0) != tokens(4, 0)


# --- how a generation ends --------------------------------------------------------------------------

def test_finish_reason_is_length_or_stop():
    assert generate(FakeStepper(), PROMPT, 8).finish_reason == "length"
    assert generate(FakeStepper(), PROMPT, 8, eos_token_id=4).finish_reason == "stop"
    assert generate(FakeStepper(), PROMPT, 6, eos_token_id=4).finish_reason == "stop"  # eos as the last allowed token


@pytest.mark.parametrize("speculate", [0, 3])
def test_a_stop_ends_at_the_token_that_completes_it(speculate):
    # With speculate=3, step 3 accepts drafts [2, 3]: the stop completes at 2, so 3 is dropped.
    calls: list[list[int]] = []
    result = generate(FakeStepper(), PROMPT, 8, speculate, on_tokens=calls.append, stop=lambda out: out[-2:] == [1, 2])

    assert result.tokens == [3, 5, 1, 2] and result.finish_reason == "stop"
    assert [t for call in calls for t in call] == result.tokens


# --- the check against a reference under a lossy wire ------------------------------------------------

GATE = GateConfig()


@pytest.mark.parametrize("perturb, cosine_at_perturbed, agreeing, passed, first", [
    ({3: (0, 0.05)}, 1 / math.sqrt(1 + 0.05**2), 13, True, None),  # close: passes
    ({3: (0, 0.25)}, 1 / math.sqrt(1 + 0.25**2), 13, False, None),  # same argmax, cosine mean 0.9977 < 0.998
    ({5: (WRONG, 2.0)}, 1 / math.sqrt(5), 12, False, "argmax differs at step 4"),  # one argmax in 13 differs
])
def test_a_lossy_check_judges_argmax_and_cosine_by_the_gates_thresholds(perturb, cosine_at_perturbed, agreeing, passed, first):
    result = generate(FakeStepper(), PROMPT, 8, reference=FakeStepper(perturb=perturb), exact_check=False)
    check = result.check

    assert result.tokens == SEQ[6:14]  # the swarm's tokens drive both
    assert (check.kind, check.positions, check.argmax_agreeing) == ("gate", 6 + 7, agreeing)  # prefill rows + 7 steps
    assert check.cosine_min == pytest.approx(cosine_at_perturbed, abs=1e-6)
    assert check.cosine_mean == pytest.approx((12 + cosine_at_perturbed) / 13, abs=1e-6)
    assert check.passed is passed
    assert check.passed == (check.argmax_agreement >= GATE.min_argmax_agreement and check.cosine_mean >= GATE.min_cosine_mean)
    assert (result.bit_identical, result.first_mismatch) == (False, first)


def test_an_exact_check_passes_only_when_bit_identical():
    assert generate(FakeStepper(), PROMPT, 8, reference=FakeStepper()).check.passed is True
    close = generate(FakeStepper(), PROMPT, 8, reference=FakeStepper(perturb={3: (0, 0.05)})).check
    assert (close.kind, close.passed, close.first_mismatch) == ("exact", False, "logits differ at step 2")
