"""The engine-wide Calibration (generation/draft_measure.py) carries across the sequences of one
engine (engine/speculation.py): what sequence 1 learned about a drafter's estimates sizes sequence
2's drafts from its first step. On a scripted model with a scripted drafter whose estimate is fixed,
under a fixed cost line, so the K of every step is the rule's answer to known inputs."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from test_engine_acceptance import FakeCache
from transformers import PretrainedConfig

from moeswarm.engine.config import EngineConfig
from moeswarm.engine.engine import Engine
from moeswarm.engine.job import Job
from moeswarm.engine.metrics import UnrecordedMetrics
from moeswarm.engine.whole_model import WholeModel
from moeswarm.generation.draft_measure import CostModel
from moeswarm.generation.goodput import StepCost
from moeswarm.generation.sampling import SamplingParams
from moeswarm.sources.tokenizer import TextCodec

VOCAB = 64
CAP = 4
LINE = StepCost(1.0, 0.1)  # a token costs a tenth of a one-token step: K = 1 pays from an acceptance of 0.15


def script(n: int) -> int:
    """The token after a context of n tokens."""
    return 7 * n % (VOCAB - 1) + 1


class Scripted(torch.nn.Module):
    """Predicts script(n) after n tokens, with a logit so far ahead that sampling at temperature 1.0
    draws it (the chance of another token is below 1e-40)."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig(vocab_size=VOCAB)
        self.context: list[int] = []
        self.crops: list[int] = []

    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True) -> SimpleNamespace:
        tokens = input_ids[0].tolist()
        if past_key_values is None:  # a new sequence (one at a time here)
            self.context = []
        logits = torch.zeros(len(tokens), VOCAB)  # [n, V]
        for row, token in enumerate(tokens):
            self.context.append(token)
            logits[row, script(len(self.context))] = 100.0
        return SimpleNamespace(logits=logits[None], past_key_values=FakeCache(self))


class Told:
    """Drafts the script's continuation (right: every draft kept) or one off it (wrong: none kept),
    and scores every position at `estimate`, whatever the outcome."""

    name = "told"

    def __init__(self, right: bool, estimate: float):
        self.right, self.estimate = right, estimate

    def draft(self, context, stepper, limit):
        return [script(len(context) + i) + (0 if self.right else 1) for i in range(limit)]

    def branches(self, context, stepper, limit):
        return [self.draft(context, stepper, limit)] if limit > 0 else []

    def support(self, context, drafts, greedy=True):
        return [[self.estimate] * len(d) for d in drafts]

    def feedback(self, drafted, accepted, cap):
        pass


class Unmeasured(CostModel):
    """The step cost fixed at LINE (wall times on a fake model are noise)."""

    def record(self, tokens: int, seconds: float) -> None:
        pass

    def record_drafting(self, seconds: float) -> None:
        pass

    def line(self) -> StepCost:
        return LINE


def _engine(right: bool, estimate: float) -> Engine:
    codec = TextCodec("ids", SimpleNamespace(eos_token_id=None, decode=lambda ids, **_: ""), VOCAB)
    config = EngineConfig(512, max_batch=1, speculate=CAP, prefill_chunk=8, step_tokens=256, cache_slots=0,
                          adaptive=True)
    engine = Engine(WholeModel(Scripted()), codec, config, UnrecordedMetrics(), None, lambda: Told(right, estimate))
    engine.speculation.cost = Unmeasured()
    return engine


def _run(engine: Engine, prompt: list[int], tokens: int, params: SamplingParams):
    tally = engine.run(Job(prompt, tokens, params, lambda event: None))
    expected = [script(len(prompt) + i) for i in range(tokens)]
    assert tally.tokens == expected  # drafts never change the output
    return tally.drafts.history


def test_a_second_sequence_drafts_from_its_first_step_at_the_acceptance_the_first_one_learned():
    """Sampled (no acceptance-EMA lift: the Calibration alone sizes the drafts). Estimated at 0.02, a
    draft is not worth a row until outcomes say it is kept; sequence 1 learns that from its shadow
    drafts, and sequence 2 of the same kind drafts at the cap from its first step."""
    engine = _engine(right=True, estimate=0.02)
    sampled = SamplingParams(temperature=1.0, seed=5)
    try:
        first = _run(engine, [1, 2, 3, 4], 30, sampled)
        second = _run(engine, [9, 8, 7, 6, 5], 30, sampled)
    finally:
        engine.close()
    # one shadow draft of 4 tokens settles after 4 steps; the last step has no room for drafts
    assert first[:4] == [0, 0, 0, 0] and set(first[5:-1]) == {CAP}, first
    assert set(second[:-1]) == {CAP}, second


def test_a_drafter_whose_drafts_were_rejected_starts_the_next_sequence_at_k_zero():
    """Greedy. Estimated at 0.9, drafts are fed at the cap until rejections bring the estimate's bucket
    down to plain decoding's break-even; sequence 2 of the same drafter then starts at K = 0 (its shadow
    drafts, still rejected, keep it there)."""
    engine = _engine(right=False, estimate=0.9)
    try:
        first = _run(engine, [1, 2, 3, 4], 60, SamplingParams())
        second = _run(engine, [9, 8, 7, 6, 5], 30, SamplingParams())
    finally:
        engine.close()
    assert first[0] == CAP and first[-10:] == [0] * 10, first
    assert first == sorted(first, reverse=True), first  # K only falls as rejections accrue
    assert second == [0] * len(second), second
