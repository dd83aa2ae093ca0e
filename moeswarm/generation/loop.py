"""The generation loop: greedy, optionally speculative, optionally checked against local.

A step feeds the last token plus up to K drafted tokens in one forward: one dispatch per MoE layer
carries all of them. Drafts are accepted while they equal the model's own greedy choice, so the
output is the greedy output whatever the drafts were. With a reference model (local eager), the
same forwards run on it and every step's logits are compared bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeswarm.generation.draft import propose
from moeswarm.generation.stepper import Stepper


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    steps: int = 0  # forwards after the prefill
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0  # in the backbone's forwards (the check against local is not counted)
    prefill_seconds: float = 0.0
    bit_identical: bool | None = None
    tokens_match: bool | None = None
    first_mismatch: str | None = None
    max_abs_diff: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def generate(model_stepper: Stepper, prompt: list[int], max_new_tokens: int, speculate: int = 0,
             reference: Stepper | None = None, eos_token_id: int | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    result = GenerationResult(list(prompt))
    if reference is not None:
        result.bit_identical, result.tokens_match = True, True
    logits = _forward(model_stepper, reference, prompt, result, "prefill")  # [P, V]
    result.prefill_seconds = result.seconds
    next_token = int(logits[-1].argmax())
    context = list(prompt)
    while True:
        result.tokens.append(next_token)
        if on_tokens:
            on_tokens([next_token])
        if len(result.tokens) >= max_new_tokens or next_token == eos_token_id:
            break
        drafts = propose(context + [next_token], min(speculate, max_new_tokens - len(result.tokens) - 1))
        feed = [next_token] + drafts
        logits = _forward(model_stepper, reference, feed, result, f"step {result.steps + 1}")  # [1 + D, V]
        result.steps += 1
        greedy = logits.argmax(dim=-1).tolist()  # [1 + D]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted] and drafts[accepted] != eos_token_id:
            accepted += 1
        result.drafted += len(drafts)
        result.accepted += accepted
        context += feed[: 1 + accepted]
        for stepper in (model_stepper, reference):
            if stepper is not None:
                stepper.crop(len(context))
        if accepted:
            result.tokens.extend(drafts[:accepted])
            if on_tokens:
                on_tokens(drafts[:accepted])
        next_token = greedy[accepted]
    return result


def _forward(stepper: Stepper, reference: Stepper | None, feed: list[int], result: GenerationResult, what: str) -> torch.Tensor:
    start = time.perf_counter()
    logits = stepper.forward(feed)
    result.seconds += time.perf_counter() - start  # the backbone's time only, not the reference's
    if reference is not None:
        expected = reference.forward(feed)
        if not torch.equal(logits, expected):
            result.bit_identical = False
            result.max_abs_diff = max(result.max_abs_diff, float((logits - expected).abs().max()))
            result.first_mismatch = result.first_mismatch or f"logits differ at {what}"
        if not torch.equal(logits.argmax(-1), expected.argmax(-1)):
            result.tokens_match = False
    return logits
