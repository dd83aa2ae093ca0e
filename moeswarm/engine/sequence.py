"""One request in the engine: its KV cache, its tokens, its sampler, and the text it has shown.

A sequence prefills its prompt (in chunks the scheduler picks), then decodes: each step feeds its
last token plus its drafts, and `advance` applies speculative sampling's accept rule to the
logits, rolls the cache back past rejected drafts, and emits the new text. Drafts come from n-gram
lookup, or from the given drafter (serve --draft local|both: generation/drafters.py).

A greedy sequence whose caches can branch (Stepper.branchable) verifies every alternative draft
its drafter has side by side, one row each (generation/branches.py, as generate does): its feed is
B rows, its logits [B, n, V], and it keeps the branch accepted longest. Those drafts are as long as
the limit allows (a draft position is cheap next to a step). A sampled sequence verifies one draft
(choosing among drafts after seeing the logits would bias its sampling), whose length follows the
sequence's own recent acceptance.

Log-probabilities (job.logprobs, job.prompt_logprobs) are the log-softmax of the very logits a step
computed: a prompt chunk's rows score the prompt's next tokens (echo), a decode row the token taken.
Such a job, and a penalised one, runs without drafts and without the prefix cache, so its values
are those of a plain forward of the prompt (in the engine's prefill chunks) and then one token per
step, whatever else is running: speculation and earlier requests never change them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeswarm.generation.branches import choose, rows_of
from moeswarm.generation.drafters import Drafter, NgramDrafter
from moeswarm.generation.sampling import biased, log_probs, make_generator, penalize, sample, top_logprobs
from moeswarm.forward.stepper import Stepper
from moeswarm.generation.stops import held_back
from moeswarm.sources.tokenizer import TextCodec
from moeswarm.engine.ending import find_stop_after, hold_eos
from moeswarm.engine.job import Delta, Finished, Job, PromptLogprobs, Rewind, TokenLogprob


@dataclass(frozen=True)
class Checkpoint:
    """A sequence between two steps: what `Sequence.restore` needs to undo the steps after it."""

    cached: int  # positions in the KV cache
    reference_cached: int
    context: int
    output: int
    shown: int
    generator_state: torch.Tensor | None  # a sampled sequence's random state
    draft_len: int
    drafted: int
    accepted: int
    prompt_scores: int


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
        self.k_limit: int | None = None  # this step's most drafts by the goodput rule (engine/speculation.py); None: not adaptive
        self.branches: list[list[int]] = [[]]  # the drafts proposed for the step being planned, one list a row
        self.branching = False  # whether this step's drafts are alternatives verified side by side
        self.drafter = drafter if drafter is not None else NgramDrafter()
        self.shown = 0  # characters of the output text already emitted
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self._stop_floor: int | None = None  # stop strings count when they end past this character (min_tokens)
        self.drafted = self.accepted = 0  # the kept branch's drafts, and how many of them were accepted
        self.prompt_scores = [TokenLogprob(job.prompt[0], None)] if job.prompt else []  # the prompt scored so far (echo)
        self.chunk: tuple[int, int] | None = None  # the prompt chunk this step feeds: (start, length)
        if job.plain_forwards:
            self.max_drafts = self.draft_len = 0
            if cached_tokens:  # a plain forward of the whole prompt, as the reference computes it
                for taker in (stepper, reference):
                    if taker is not None:
                        taker.cache = None
                self.cached_tokens = 0

    @property
    def scored(self) -> bool:
        """Whether log-probabilities are asked: then every forward of this sequence must be its own (not
        packed with other sequences', whose rows would change the bits of its logits: engine/scheduler.py's `apart`)."""
        return self.job.logprobs is not None or self.job.prompt_logprobs is not None

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
        self.branching = not self.prefill_left and self._can_branch()
        limit = min(self.max_drafts if self.branching else self.draft_len, room)
        if self.k_limit is not None:  # the goodput rule's K replaces the sampled draft length's own rule
            limit = min(self.k_limit, room)
        self.branches = [[]]
        if self.prefill_left or limit <= 0:
            return
        # the drafter may run forwards on this sequence's cache (local drafts): only between the engine's steps
        if self.branching:
            self.branches = [b for b in self.drafter.branches(self.context, self.stepper, limit) if b] or [[]]
        else:
            self.branches = [self.drafter.draft(self.context, self.stepper, limit)]
        if self.job.constraint is not None:  # drafts the grammar refuses are never fed
            self.branches = [self.job.constraint.valid_drafts(self.branches[0])]

    def _can_branch(self) -> bool:
        return (self.job.params.greedy and self.job.constraint is None and self.stepper.branchable
                and (self.reference is None or self.reference.branchable))

    @property
    def draft_counts(self) -> tuple[int, ...]:
        """Each planned branch's draft tokens (the scheduler's view); () when there are none."""
        return tuple(len(b) for b in self.branches) if any(self.branches) else ()

    def feed(self, tokens: int, rows: int = 1) -> list[int] | list[list[int]]:
        """What this step feeds: a prompt chunk of `tokens`, or the last token and the drafts of the
        first `rows` branches (one list when one branch; else B padded rows: generation/branches.py)."""
        if self.prefill_left:
            start = self.stepper.length
            chunk = self.job.prompt[start : start + tokens]
            self.chunk = (start, len(chunk))
            return chunk
        self.chunk = None
        self.branches = self.branches[: max(1, rows)]
        if len(self.branches) == 1:
            return [self.context[-1]] + self.branches[0]
        return rows_of(self.context[-1], self.branches)  # [B][1 + L]

    def advance(self, logits: torch.Tensor) -> None:
        """Take this step's logits ([n, V] for one row, [B, n, V] for B rows: what `feed` gave) and emit
        what they decide."""
        if self.chunk is not None and self.job.prompt_logprobs is not None:
            self._score_prompt(logits)
        if self.prefill_left:
            return  # more prompt to go
        if not self.output:  # the prompt just finished: its last logits give the first token
            if self.job.prompt_logprobs is not None:
                self.job.emit(PromptLogprobs(tuple(self.prompt_scores)))
            if self.job.max_tokens == 0:  # scoring the prompt only
                self.finish_reason = "length"
                self._emit_text([])
                return
            last = logits[-1]  # [V]
            scores = biased(penalize(last, self.context, 0, self.job.params), self.job.params)
            scores = hold_eos(scores[None], self.eos, 0, self.job.min_tokens)[0]
            if self.job.constraint is not None:
                scores = self.job.constraint.mask(scores[None])[0]
            token = sample(scores, self.job.params, self.generator)
            self._accept([token], [last])
            return
        branches = self.branches
        rows = logits if logits.dim() == 3 else logits[None]  # [B, 1 + L, V]
        if self.job.params.penalised:  # no drafts then: one row of one position
            rows = penalize(rows[0, 0], self.context, len(self.output), self.job.params)[None, None]
        rows = hold_eos(biased(rows, self.job.params), self.eos, len(self.output), self.job.min_tokens)
        if self.job.constraint is not None:  # one branch: each position masked after the drafts before it
            rows = self.job.constraint.mask(rows[0], branches[0])[None]
        chosen = choose(rows, branches, self.job.params, self.generator, self.eos)
        drafts, accepted = branches[chosen.row], chosen.accepted
        for stepper in (self.stepper, self.reference):
            if stepper is not None:
                stepper.keep_row(chosen.row)  # nothing to do for one row
                stepper.crop(len(self.context) + accepted)  # the fed token and the accepted drafts stay
        self.drafted += len(drafts)
        self.accepted += accepted
        if drafts and not self.branching:
            self.draft_len = min(self.max_drafts, self.draft_len + 1) if accepted == len(drafts) else max(1, accepted)
        kept = logits if logits.dim() == 3 else logits[None]
        self._accept(drafts[:accepted] + [chosen.next_token], list(kept[chosen.row, : accepted + 1]))

    @property
    def eos(self) -> int | None:
        """The token that ends the output (None with ignore_eos: engine/ending.py)."""
        return None if self.job.ignore_eos else self.codec.eos_token_id

    def checkpoint(self) -> Checkpoint:
        greedy = self.job.params.greedy
        return Checkpoint(self.stepper.length, self.reference.length if self.reference is not None else 0,
                          len(self.context), len(self.output), self.shown, None if greedy else self.generator.get_state(),
                          self.draft_len, self.drafted, self.accepted, len(self.prompt_scores))

    def restore(self, point: Checkpoint) -> None:
        """Undo every step after `point` (their logits came from a liar's answers) and tell the caller
        to take back what they emitted; the next steps compute them again. A grammar-constrained
        sequence cannot rewind its grammar: ValueError."""
        if self.job.constraint is not None:
            raise ValueError("a constrained request cannot rewind its grammar")
        for stepper, length in ((self.stepper, point.cached), (self.reference, point.reference_cached)):
            if stepper is not None:
                stepper.keep_row(0)
                stepper.crop(length)
        del self.context[point.context :]
        del self.output[point.output :]
        del self.prompt_scores[point.prompt_scores :]
        if point.generator_state is not None:
            self.generator.set_state(point.generator_state)
        self.shown, self.draft_len, self.drafted, self.accepted = point.shown, point.draft_len, point.drafted, point.accepted
        self.finish_reason = None
        self._stop_floor = None
        self.job.emit(Rewind(point.shown, point.output))

    def _score_prompt(self, logits: torch.Tensor) -> None:
        """Score the prompt tokens that this chunk's rows predict: row i of a chunk from `start` gives
        the log-probabilities of prompt token start + i + 1."""
        start, length = self.chunk
        if logits.dim() != 2 or logits.shape[0] != length:
            raise ValueError(f"prompt log-probabilities need every row of the prompt chunk: got logits "
                             f"{list(logits.shape)} for {length} tokens")
        prompt = self.job.prompt
        scored = min(length, len(prompt) - start - 1)  # the last prompt token's row predicts the output
        if scored <= 0:
            return
        rows = log_probs(logits[:scored])  # [scored, V]
        for i in range(scored):
            token = prompt[start + i + 1]
            rank = int((rows[i] > rows[i][token]).sum()) + 1
            self.prompt_scores.append(TokenLogprob(token, *top_logprobs(rows[i], token, self.job.prompt_logprobs), rank))

    def _accept(self, tokens: list[int], rows: list[torch.Tensor]) -> None:
        """Take `tokens`; rows[i] is the logits [V] token i was chosen from (for its log-probability)."""
        eos = self.eos
        new, taken = [], 0
        for token in tokens:
            taken += 1
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
        if self.job.constraint is not None:
            self.job.constraint.accept(tokens[:taken])
            if self.job.constraint.finished:  # the grammar is complete (on the last token max_tokens allows too)
                self.finish_reason = "stop"
        scores = ()
        if self.job.logprobs is not None:
            scores = tuple(TokenLogprob(token, *top_logprobs(log_probs(row), token, self.job.logprobs))
                           for token, row in zip(tokens[:taken], rows))
        self._emit_text(new, scores)

    def _emit_text(self, new: list[int], scores: tuple[TokenLogprob, ...] = ()) -> None:
        eos = self.codec.eos_token_id
        visible = [token for token in self.output if token != eos]  # ignore_eos: end-of-text tokens are not shown
        text = self.codec.decode(visible)
        stop_at = None
        if self.job.stops and len(self.output) >= self.job.min_tokens:
            if self._stop_floor is None:
                before = self.output[: max(0, self.job.min_tokens - 1)]
                self._stop_floor = len(self.codec.decode([t for t in before if t != eos])) if before else 0
            stop_at = find_stop_after(text, self.job.stops, self._stop_floor)
        if stop_at is not None:
            text, self.finish_reason = text[:stop_at], "stop"
        if self.done:
            end = len(text)
        else:
            end = len(text) - held_back(text, self.job.stops)
            while end > self.shown and text[end - 1] == "\ufffd":  # half a character: wait for the rest
                end -= 1
        if end > self.shown or new or scores:
            self.job.emit(Delta(text[self.shown:end], tuple(new), scores))
            self.shown = max(self.shown, end)
        if self.done:
            self.job.emit(Finished(self.finish_reason, len(self.job.prompt), len(self.output), self.cached_tokens))

