"""One request in the engine: its KV cache, its tokens, its sampler, and the text it has shown.

A sequence prefills its prompt (in chunks the scheduler picks), then decodes: each step feeds its
last token plus its drafts, and `advance` applies speculative sampling's accept rule to the
logits, rolls the cache back past rejected drafts, and emits the new text. The draft length
follows the sequence's own recent acceptance. Drafts come from n-gram lookup, or from the given
drafter (serve --draft local|both: generation/drafters.py).
"""

from __future__ import annotations

import time

import torch

from moeswarm.generation.draft import propose
from moeswarm.generation.drafters import Drafter
from moeswarm.generation.sampling import make_generator, sample, verify
from moeswarm.generation.stepper import Stepper
from moeswarm.generation.stops import find_stop, held_back
from moeswarm.model.tokenizer import TextCodec
from moeswarm.serve.job import Delta, Finished, Job


class Sequence:
    def __init__(self, job: Job, stepper: Stepper, codec: TextCodec, speculate: int, cached_tokens: int = 0,
                 reference: Stepper | None = None, drafter: Drafter | None = None):
        self.job = job
        self.stepper = stepper
        self.reference = reference  # the same forwards on a local eager model (serve --check-local)
        self.codec = codec
        self.generator = make_generator(job.params.seed)
        self.context = list(job.prompt)  # every known token: prompt, then accepted output
        self.output: list[int] = []
        self.cached_tokens = cached_tokens
        self.max_drafts = speculate
        self.draft_len = speculate
        self.drafts: list[int] = []  # proposed for the step being planned
        self.drafter = drafter  # None: n-gram lookup
        self.shown = 0  # characters of the output text already emitted
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.drafted = self.accepted = 0

    @property
    def prefill_left(self) -> int:
        """Prompt tokens not yet in the KV cache (0 once the first token is out)."""
        return 0 if self.output else len(self.job.prompt) - self.stepper.length

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def plan_drafts(self, context_limit: int) -> None:
        """Propose this step's drafts: within the draft length, max_tokens and the context."""
        room = min(self.job.max_tokens - len(self.output) - 1, context_limit - len(self.context) - 1)
        limit = min(self.draft_len, room)
        if self.prefill_left or limit <= 0:
            self.drafts = []
        elif self.drafter is None:
            self.drafts = propose(self.context, limit)
        else:  # runs forwards on this sequence's cache (local drafts): only between the engine's steps
            self.drafts = self.drafter.draft(self.context, self.stepper, limit)

    def feed(self, prefill: int) -> list[int]:
        """The tokens this step feeds: a prompt chunk, or the last token and the drafts."""
        if self.prefill_left:
            start = self.stepper.length
            return self.job.prompt[start : start + prefill]
        return [self.context[-1]] + self.drafts

    def advance(self, logits: torch.Tensor) -> None:
        """Take this step's logits [n, V] (n = what `feed` gave) and emit what they decide."""
        if self.prefill_left:
            return  # more prompt to go
        if not self.output:  # the prompt just finished: its last logits give the first token
            self._accept([sample(logits[-1], self.job.params, self.generator)])
            return
        drafts = self.drafts
        accepted, next_token = verify(logits, drafts, self.job.params, self.generator)  # logits [1 + D, V]
        for stepper in (self.stepper, self.reference):
            if stepper is not None:
                stepper.crop(len(self.context) + accepted)  # the fed token and the accepted drafts stay
        self.drafted += len(drafts)
        self.accepted += accepted
        if drafts:
            self.draft_len = min(self.max_drafts, self.draft_len + 1) if accepted == len(drafts) else max(1, accepted)
        self._accept(drafts[:accepted] + [next_token])

    def _accept(self, tokens: list[int]) -> None:
        eos = self.codec.eos_token_id
        new = []
        for token in tokens:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.output.append(token)
            self.context.append(token)
            if token == eos:
                self.finish_reason = "stop"
                break
            new.append(token)
            if len(self.output) >= self.job.max_tokens:
                self.finish_reason = "length"
                break
        self._emit_text(new)

    def _emit_text(self, new: list[int]) -> None:
        visible = self.output[:-1] if self.output and self.output[-1] == self.codec.eos_token_id else self.output
        text = self.codec.decode(visible)
        stop_at = find_stop(text, self.job.stops)
        if stop_at is not None:
            text, self.finish_reason = text[:stop_at], "stop"
        if self.done:
            end = len(text)
        else:
            end = len(text) - held_back(text, self.job.stops)
            while end > self.shown and text[end - 1] == "\ufffd":  # half a character: wait for the rest
                end -= 1
        if end > self.shown or new:
            self.job.emit(Delta(text[self.shown:end], tuple(new)))
            self.shown = max(self.shown, end)
        if self.done:
            self.job.emit(Finished(self.finish_reason, len(self.job.prompt), len(self.output), self.cached_tokens))
