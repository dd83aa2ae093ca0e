"""The engine's one acceptance rule on a fake model: greedy, sampled, speculative, eos, stops,
limits, the check against a reference. Every generation is `generate`: one request in the engine,
stepped until it ends (engine/sequence.py's rule, as every served request).

The fake model knows one sequence SEQ: after a context equal to SEQ's first n tokens it predicts
SEQ[n]; after any other context it predicts WRONG. A rejected draft left in its cache (a missed
crop) would therefore show up as WRONG tokens in the output.

Its cache is not transformers' DynamicCache, so it cannot branch: a step verifies one draft, whose
length follows the sequence's acceptance (the full --speculate at first; after a draft taken whole,
one more, up to the cap; after a rejection, the number accepted, at least 1).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_sampling import assert_matches  # chi-square (scipy) and a total-variation bound
from transformers import PretrainedConfig

from moeswarm.gate import GateConfig
from moeswarm.engine.generate import generate
from moeswarm.generation.sampling import SamplingParams, probabilities
from moeswarm.sources.tokenizer import TextCodec
from moeswarm.engine.job import Delta
from moeswarm.engine.whole_model import WholeModel
from moeswarm.wire.config import EXACT, WAN

SEQ = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2, 3, 4]
PROMPT = SEQ[:6]  # [1, 2, 3, 4, 1, 2]
VOCAB = 12
WRONG = 9


class FakeCache:
    """What the engine's Stepper needs of a KV cache: its length, and cropping (recorded)."""

    def __init__(self, model: "FakeModel"):
        self.model = model

    def get_seq_length(self) -> int:
        return len(self.model.context)

    def crop(self, surplus: int) -> None:  # transformers 5: the number of positions to remove, negated
        del self.model.context[surplus:]
        self.model.crops.append(len(self.model.context))


class FakeModel(torch.nn.Module):
    """A transformers-like model: forward(input_ids [1, n], past_key_values) -> logits [1, n, V] float32."""

    def __init__(self, sequence: list[int] = SEQ, perturb: dict[int, tuple[int, float]] | None = None):
        super().__init__()
        self.config = PretrainedConfig(vocab_size=VOCAB)
        self.sequence = sequence
        self.context: list[int] = []
        self.feeds: list[list[int]] = []
        self.crops: list[int] = []  # the cache's length after each crop (rejected drafts rolled back)
        self.perturb = perturb or {}  # forward call number -> (vocab index, value added to its last row)

    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True) -> SimpleNamespace:
        tokens = input_ids[0].tolist()
        self.feeds.append(tokens)
        logits = torch.zeros(len(tokens), VOCAB)  # [n, V]
        for row, token in enumerate(tokens):
            self.context.append(token)
            logits[row, self._next(self.context)] = 1.0
        if len(self.feeds) in self.perturb:
            column, value = self.perturb[len(self.feeds)]
            logits[-1, column] += value
        return SimpleNamespace(logits=logits[None], past_key_values=FakeCache(self))

    def _next(self, context: list[int]) -> int:
        n = len(context)
        return self.sequence[n] if n < len(self.sequence) and context == self.sequence[:n] else WRONG


class ByteTokenizer:
    """Token i is the character chr(i); `eos` ends a generation (stop strings are looked for in this text)."""

    def __init__(self, eos: int | None):
        self.eos_token_id = eos

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def codec(eos: int | None = None) -> TextCodec:
    return TextCodec("bytes", ByteTokenizer(eos), VOCAB)


def run(model: FakeModel, prompt: list[int], max_new_tokens: int, speculate: int = 0, *, eos: int | None = None,
        reference: FakeModel | None = None, lossy: bool = False, **options):
    """`generate` on `model`, with n-gram drafts (prompt lookup: the counts below are worked out by hand)."""
    return generate(WholeModel(model, WAN if lossy else EXACT), prompt, max_new_tokens, speculate,
                    reference, codec=codec(eos), draft="ngram", **options)


def test_greedy_follows_the_model():
    model = FakeModel()
    result = run(model, PROMPT, 8)

    assert result.tokens == SEQ[6:14] == [3, 5, 1, 2, 3, 4, 1, 2]
    assert (result.steps, result.drafted, result.accepted) == (7, 0, 0)
    assert model.feeds == [PROMPT, [3], [5], [1], [2], [3], [4], [1]]
    assert model.crops == [] and len(model.context) == 13  # no draft, nothing to roll back
    assert result.prompt_tokens == PROMPT
    assert (result.bit_identical, result.tokens_match, result.first_mismatch, result.max_abs_diff) == (None, None, None, 0.0)


def test_speculation_keeps_the_greedy_tokens_with_counts_by_hand():
    # step 1: draft [4, 1, 2] after trigram [1, 2, 3]; the model says 5: none accepted (length now 1)
    # step 2: no n-gram of [..., 3, 5] occurred before: no draft
    # step 3: draft [2] after unigram [1]; the model says 2, then 3: accepted whole (length now 2)
    # step 4: draft [5, 1] after trigram [1, 2, 3] (its latest occurrence); the model says 4: none accepted
    # step 5: one token of room left: draft [1] after trigram [2, 3, 4]; accepted
    model = FakeModel()
    result = run(model, PROMPT, 8, speculate=3)

    assert result.tokens == [3, 5, 1, 2, 3, 4, 1, 2]
    assert (result.steps, result.drafted, result.accepted) == (5, 7, 2)
    assert model.feeds == [PROMPT, [3, 4, 1, 2], [5], [1, 2], [3, 5, 1], [4, 1]]
    assert model.crops == [7, 11]  # rejected drafts rolled back
    assert model.context == SEQ[:13]


def test_a_periodic_sequence_accepts_every_draft():
    cycle = [0, 1, 2, 3] * 4
    model = FakeModel(cycle)
    result = run(model, cycle[:5], 8, speculate=3)

    assert result.tokens == cycle[5:13] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert (result.steps, result.drafted, result.accepted) == (2, 5, 5)
    assert model.feeds == [cycle[:5], [1, 2, 3, 0], [1, 2, 3]]


@pytest.mark.parametrize("speculate", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 8, 10])
def test_max_new_tokens_is_exact_and_speculation_changes_nothing(max_new_tokens, speculate):
    model = FakeModel()
    result = run(model, PROMPT, max_new_tokens, speculate)

    assert result.tokens == SEQ[6 : 6 + max_new_tokens]
    assert len(result.tokens) == 1 + result.steps + result.accepted  # prefill's token, one per step, accepted drafts
    assert len(model.feeds) == 1 + result.steps
    assert sum(map(len, model.feeds)) == len(PROMPT) + result.steps + result.drafted
    assert all(len(feed) <= 1 + speculate for feed in model.feeds[1:])


def test_one_new_token_is_the_prefill_alone():
    model = FakeModel()
    result = run(model, PROMPT, 1, speculate=4)
    assert result.tokens == [3] and result.steps == 0 and model.feeds == [PROMPT] and model.crops == []


def test_eos_stops_generation():
    result = run(FakeModel(), PROMPT, 8, eos=4)
    assert result.tokens == [3, 5, 1, 2, 3, 4] and result.steps == 5


def test_eos_stops_speculation_and_is_never_accepted_as_a_draft():
    model = FakeModel()
    result = run(model, PROMPT, 8, speculate=3, eos=2)

    # step 3 drafts [2]: the model agrees on 2, but 2 is eos, so it comes as the step's own token
    assert result.tokens == [3, 5, 1, 2]
    assert (result.steps, result.drafted, result.accepted) == (3, 4, 0)
    assert model.feeds == [PROMPT, [3, 4, 1, 2], [5], [1, 2]]


def test_eos_from_the_prefill():
    result = run(FakeModel(), PROMPT, 8, speculate=3, eos=3)
    assert result.tokens == [3] and result.steps == 0


def test_the_events_give_every_token_in_order():
    events: list = []
    result = run(FakeModel(), PROMPT, 8, speculate=3, on_event=events.append)

    calls = [list(event.tokens) for event in events if isinstance(event, Delta)]
    assert calls == [[3], [5], [1], [2, 3], [4], [1, 2]]  # [2, 3] and [1, 2]: an accepted draft and the next token
    assert [t for call in calls for t in call] == result.tokens


def test_a_reference_equal_to_the_model_is_bit_identical():
    model, reference = FakeModel(), FakeModel()
    result = run(model, PROMPT, 8, speculate=3, reference=reference)

    assert (result.bit_identical, result.tokens_match, result.first_mismatch, result.max_abs_diff) == (True, True, None, 0.0)
    assert reference.feeds == model.feeds and reference.crops == model.crops  # the reference saw the same forwards


def test_a_reference_that_differs_at_one_step_is_named():
    # forward call 3 is step 2; 0.25 on a non-argmax logit changes the bits, not the token
    result = run(FakeModel(), PROMPT, 8, reference=FakeModel(perturb={3: (0, 0.25)}))

    assert result.tokens == SEQ[6:14]  # the model's tokens, not the reference's
    assert (result.bit_identical, result.tokens_match) == (False, True)
    assert result.first_mismatch == "logits differ at step 2"
    assert result.max_abs_diff == 0.25


def test_the_first_mismatch_is_kept_and_the_largest_difference_reported():
    reference = FakeModel(perturb={1: (0, 0.125), 4: (7, 0.5)})
    result = run(FakeModel(), PROMPT, 8, reference=reference)

    assert (result.bit_identical, result.tokens_match) == (False, True)
    assert result.first_mismatch == "logits differ at prefill"
    assert result.max_abs_diff == 0.5


def test_a_reference_with_another_argmax_does_not_match_tokens():
    result = run(FakeModel(), PROMPT, 8, reference=FakeModel(perturb={5: (WRONG, 2.0)}))

    assert result.tokens == SEQ[6:14]
    assert (result.bit_identical, result.tokens_match) == (False, False)
    assert result.first_mismatch == "logits differ at step 4"
    assert result.max_abs_diff == 2.0


def test_an_empty_prompt_is_refused_before_any_forward():
    model = FakeModel()
    with pytest.raises(ValueError) as caught:
        run(model, [], 8)
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


class MarkovModel(FakeModel):
    """Logits after each token are MARKOV's row for that token: a model with a real distribution."""

    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True) -> SimpleNamespace:
        tokens = input_ids[0].tolist()
        self.feeds.append(tokens)
        self.context += tokens
        return SimpleNamespace(logits=MARKOV[tokens].clone()[None], past_key_values=FakeCache(self))  # [1, n, 4]


def test_sampled_generation_with_or_without_speculation_follows_the_model():
    """The joint law of three sampled tokens is the chain's, speculating or not (chi-square, fixed seed)."""
    law = probabilities(MARKOV, SAMPLED).double()  # [4, 4]
    expected = {(a, b, c): float(law[CYCLE[-1], a] * law[a, b] * law[b, c]) for a in range(4) for b in range(4) for c in range(4)}
    runs = 1500
    for speculate in (0, 3):
        counts, drafted = Counter(), 0
        for seed in range(runs):
            sampling = replace(SAMPLED, seed=seed + runs * speculate)
            result = run(MarkovModel(), CYCLE, 3, speculate, sampling=sampling)
            counts[tuple(result.tokens)] += 1
            drafted += result.drafted
        assert (drafted > runs // 2) if speculate else (drafted == 0)  # speculation really ran (or really did not)
        assert_matches(counts, expected, runs)  # top-k's zeros never appear, the rest in proportion


def test_sampling_with_a_seed_is_reproducible():
    def tokens(seed: int, speculate: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        return run(MarkovModel(), CYCLE, 24, speculate, sampling=params).tokens

    assert tokens(3, 0) == tokens(3, 0) and tokens(3, 4) == tokens(3, 4)
    assert tokens(3, 0) != tokens(4, 0)


# --- how a generation ends --------------------------------------------------------------------------

def test_finish_reason_is_length_or_stop():
    assert run(FakeModel(), PROMPT, 8).finish_reason == "length"
    assert run(FakeModel(), PROMPT, 8, eos=4).finish_reason == "stop"
    assert run(FakeModel(), PROMPT, 6, eos=4).finish_reason == "stop"  # eos as the last allowed token


@pytest.mark.parametrize("speculate, tokens", [(0, [3, 5, 1, 2]), (3, [3, 5, 1, 2, 3])])
def test_a_stop_ends_the_text_where_it_begins(speculate, tokens):
    # The stop string is tokens [1, 2]'s text. With speculate=3, step 3 takes draft [2] and then 3:
    # the stop completes inside the step, and its text and everything after it are never shown.
    events: list = []
    result = run(FakeModel(), PROMPT, 8, speculate, stops=("\x01\x02",), on_event=events.append)

    assert result.tokens == tokens and result.finish_reason == "stop"
    assert result.text == "\x03\x05" == "".join(event.text for event in events if isinstance(event, Delta))


# --- the check against a reference under a lossy wire ------------------------------------------------

GATE = GateConfig()


@pytest.mark.parametrize("perturb, cosine_at_perturbed, agreeing, passed, first", [
    ({3: (0, 0.05)}, 1 / math.sqrt(1 + 0.05**2), 13, True, None),  # close: passes
    ({3: (0, 0.25)}, 1 / math.sqrt(1 + 0.25**2), 13, False, None),  # same argmax, cosine mean 0.9977 < 0.998
    ({5: (WRONG, 2.0)}, 1 / math.sqrt(5), 12, False, "argmax differs at step 4"),  # one argmax in 13 differs
])
def test_a_lossy_check_judges_argmax_and_cosine_by_the_gates_thresholds(perturb, cosine_at_perturbed, agreeing, passed, first):
    result = run(FakeModel(), PROMPT, 8, reference=FakeModel(perturb=perturb), lossy=True)
    check = result.check

    assert result.tokens == SEQ[6:14]  # the swarm's tokens drive both
    assert (check.kind, check.positions, check.argmax_agreeing) == ("gate", 6 + 7, agreeing)  # prefill rows + 7 steps
    assert check.cosine_min == pytest.approx(cosine_at_perturbed, abs=1e-6)
    assert check.cosine_mean == pytest.approx((12 + cosine_at_perturbed) / 13, abs=1e-6)
    assert check.passed is passed
    assert check.passed == (check.argmax_agreement >= GATE.min_argmax_agreement and check.cosine_mean >= GATE.min_cosine_mean)
    assert (result.bit_identical, result.first_mismatch) == (False, first)


def test_an_exact_check_passes_only_when_bit_identical():
    assert run(FakeModel(), PROMPT, 8, reference=FakeModel()).check.passed is True
    close = run(FakeModel(), PROMPT, 8, reference=FakeModel(perturb={3: (0, 0.05)})).check
    assert (close.kind, close.passed, close.first_mismatch) == ("exact", False, "logits differ at step 2")
