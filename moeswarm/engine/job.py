"""A request as the engine sees it, and what the engine tells its caller back.

The engine calls `job.emit(event)` from its own thread; the HTTP side hops each event onto its
event loop. A caller that goes away sets `job.cancelled`; the engine frees the slot at its next step.

A job asking for log-probabilities decodes without drafts: its values are then those of one
forward per token, whatever --speculate says, so speculation never changes them. max_tokens 0 is
for scoring a prompt (prompt_logprobs): the prompt is prefilled and nothing is sampled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moeswarm.generation.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token and the model's log-probability of it, with the likeliest alternatives."""

    token: int
    logprob: float | None  # None: the prompt's first token, which nothing before it predicts
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), likeliest first; () when not asked
    rank: int | None = None  # 1 + the tokens more likely than it (a prompt token's, for prompt_logprobs)


@dataclass(frozen=True)
class Delta:
    """New output: the text now safe to show (no partial stop string, no half character)."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # each new token's (the end-of-text token's too), when the job asks


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's tokens scored by the model (echo): the first one's logprob is None."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of text or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache


@dataclass(frozen=True)
class Failed:
    message: str  # one line, safe to print
    status: int = 503  # the HTTP status the caller should answer with
    cause: BaseException | None = field(default=None, compare=False)  # what failed the step (generate raises it)


@dataclass(frozen=True)
class Rewind:
    """Take back the output after its first `text` characters and `tokens` tokens (and their
    log-probabilities): a worker caught lying later served the steps after them. What follows
    replaces it; a streamed answer cannot take text back and ends with an error instead."""

    text: int
    tokens: int


Event = Delta | PromptLogprobs | Finished | Failed | Rewind


@dataclass(eq=False)
class Job:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    emit: Callable[[Event], None]
    stops: tuple[str, ...] = ()
    speculate: int | None = None  # most drafts per step, capped by the engine's --speculate; None: that cap
    logprobs: int | None = None  # each new token's log-probability and this many alternatives; None: off
    # the same for every prompt token (echo; no prefix cache); None: off. The HTTP side sets it with logprobs:
    # every row of the prompt is then computed, so the first new token's values are a plain forward's
    prompt_logprobs: int | None = None
    constraint: object | None = None  # a grammar.Constraint: masks the logits before each token is chosen
    ignore_eos: bool = False  # the end-of-text token is a token like any other: only max_tokens ends the output
    min_tokens: int = 0  # no end-of-text token and no stop string before this many new tokens (vLLM's meaning)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    @property
    def plain_forwards(self) -> bool:
        """Log-probabilities or penalties asked: no drafts and no reused prefix, so its values are
        those of a plain forward of the prompt, then one token a step."""
        return self.logprobs is not None or self.prompt_logprobs is not None or self.params.penalised
