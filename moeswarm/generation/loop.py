"""The generation loop: greedy or sampled, optionally speculative, optionally checked against local.

A step feeds the last token plus up to K drafted tokens in one forward: one dispatch per MoE layer
carries all of them; a greedy step may carry several alternative drafts, one row each
(generation/branches.py). `verify` keeps or rejects the drafts (greedy: while they equal the argmax;
sampled: speculative sampling's rule), so the output follows the model's own distribution
whatever the drafts were: exactly the greedy output when greedy. The drafts come from a drafter
(`generation/drafters.py`: n-gram lookup by default, or the backbone's local experts). With a reference model (local
eager), the same forwards run on it and every step is compared (`generation/check.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeswarm.generation.branches import choose, rows_of
from moeswarm.generation.check import LocalCheck
from moeswarm.generation.drafters import Drafter, NgramDrafter
from moeswarm.generation.sampling import SamplingParams, make_generator, sample
from moeswarm.generation.stepper import Stepper

GREEDY = SamplingParams()


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    steps: int = 0  # forwards after the prefill
    drafted: int = 0  # draft tokens of the branches kept (one a step)
    accepted: int = 0
    branches: int = 0  # drafts verified side by side, summed over the steps (generation/branches.py)
    drafted_all: int = 0  # draft tokens verified, over every branch
    seconds: float = 0.0  # in the backbone's forwards and the drafting (the check against local is not counted)
    draft_seconds: float = 0.0  # drafting (local drafts: the local-experts forwards)
    prefill_seconds: float = 0.0
    finish_reason: str | None = None  # "stop": eos or a stop string; "length": max_new_tokens reached
    check: LocalCheck | None = None  # with a reference

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def bit_identical(self) -> bool | None:
        return None if self.check is None else self.check.bit_identical

    @property
    def tokens_match(self) -> bool | None:
        return None if self.check is None else self.check.tokens_match

    @property
    def first_mismatch(self) -> str | None:
        return None if self.check is None else self.check.first_mismatch

    @property
    def max_abs_diff(self) -> float:
        return 0.0 if self.check is None else self.check.max_abs_diff


def generate(model_stepper: Stepper, prompt: list[int], max_new_tokens: int, speculate: int = 0,
             reference: Stepper | None = None, eos_token_id: int | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, *, sampling: SamplingParams = GREEDY,
             generator: torch.Generator | None = None, stop: Callable[[list[int]], bool] | None = None,
             exact_check: bool = True, drafter: Drafter | None = None) -> GenerationResult:
    """Up to `max_new_tokens` tokens after `prompt`.

    generator: the sampling's random source (default: one seeded with `sampling.seed`).
    stop: called with the output after each token; True ends the generation there (stop strings).
    exact_check: compare with `reference` bit for bit; False: by the gate's argmax/cosine thresholds.
    drafter: where up to `speculate` drafts per step come from (default: n-gram lookup).
    """
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    generator = generator if generator is not None else make_generator(sampling.seed)
    drafter = drafter if drafter is not None else NgramDrafter()
    result = GenerationResult(list(prompt), check=LocalCheck(exact_check) if reference is not None else None)
    # Without a reference to compare every position with, the prompt's last logits are all it needs.
    last_only = reference is None and getattr(model_stepper, "head_rows_independent", False)
    logits = _forward(model_stepper, reference, prompt, result, "prefill", last_only)  # [P or 1, V]
    result.prefill_seconds = result.seconds
    next_token = sample(logits[-1], sampling, generator)
    context = list(prompt)
    while not _emit(result, [next_token], max_new_tokens, eos_token_id, stop, on_tokens):
        room = min(speculate, max_new_tokens - len(result.tokens) - 1)
        start = time.perf_counter()
        branches = [b for b in _drafts(drafter, context + [next_token], model_stepper, reference, room, sampling) if b]
        branches = branches or [[]]
        drafting_s = time.perf_counter() - start
        result.draft_seconds += drafting_s
        result.seconds += drafting_s
        rows = rows_of(next_token, branches)  # [B][1 + L]
        logits = _forward(model_stepper, reference, rows, result, f"step {result.steps + 1}")  # [B, 1 + L, V]
        result.steps += 1
        result.branches += len(branches)
        chosen = choose(logits, branches, sampling, generator, eos_token_id)
        drafts, accepted, next_token = branches[chosen.row], chosen.accepted, chosen.next_token
        result.drafted += len(drafts)
        result.drafted_all += sum(len(b) for b in branches)
        result.accepted += accepted
        drafter.feedback(len(drafts), accepted, speculate)
        context += [rows[chosen.row][0]] + drafts[:accepted]
        for stepper in (model_stepper, reference):
            if stepper is not None:
                if len(rows) > 1:
                    stepper.keep_row(chosen.row)
                stepper.crop(len(context))
        if accepted and _emit(result, drafts[:accepted], max_new_tokens, eos_token_id, stop, on_tokens):
            break
    return result


def _emit(result: GenerationResult, tokens: list[int], max_new_tokens: int, eos_token_id: int | None,
          stop: Callable[[list[int]], bool] | None, on_tokens: Callable[[list[int]], None] | None) -> bool:
    """Append `tokens` one by one until one ends the generation (then set finish_reason, return True)."""
    taken = 0
    for token in tokens:
        result.tokens.append(token)
        taken += 1
        if token == eos_token_id or (stop is not None and stop(result.tokens)):
            result.finish_reason = "stop"
        elif len(result.tokens) >= max_new_tokens:
            result.finish_reason = "length"
        if result.finish_reason:
            break
    if on_tokens:
        on_tokens(tokens[:taken])
    return result.finish_reason is not None


def _drafts(drafter: Drafter, context: list[int], stepper: Stepper, reference: Stepper | None, room: int,
            sampling: SamplingParams) -> list[list[int]]:
    """The step's drafts: every branch the drafter has when greedy and both caches can branch, else one draft."""
    if room <= 0:
        return []
    if sampling.greedy and stepper.branchable and (reference is None or reference.branchable):
        return drafter.branches(context, stepper, room)
    return [drafter.draft(context, stepper, room)]


def _forward(stepper: Stepper, reference: Stepper | None, feed: list[int] | list[list[int]], result: GenerationResult,
             what: str, last_only: bool = False) -> torch.Tensor:
    """feed: tokens (the prefill; logits [n, V], or [1, V] with last_only) or B rows of n tokens (a step;
    logits [B, n, V])."""
    if feed and isinstance(feed[0], list):  # one row is an ordinary forward: no branch machinery needed
        run = (lambda s: s.forward_rows(feed)) if len(feed) > 1 else (lambda s: s.forward(feed[0])[None])
    else:
        run = (lambda s: s.forward(feed, last_only=True)) if last_only else (lambda s: s.forward(feed))
    start = time.perf_counter()
    logits = run(stepper)
    result.seconds += time.perf_counter() - start  # the backbone's time only, not the reference's
    if reference is not None:
        vocabulary = logits.shape[-1]
        result.check.compare(logits.reshape(-1, vocabulary), run(reference).reshape(-1, vocabulary), what)
    return logits
