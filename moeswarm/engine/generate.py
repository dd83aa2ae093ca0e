"""One generation: one request submitted to the serving engine (engine/engine.py), stepped until it ends.

There is one decode loop, the engine's: `generate` gives a request the same sequence, acceptance
rule and local check as every served request. Its prompt goes in forwards of up to PREFILL_CHUNK
tokens (a worker bounds the reply it will compute: docs/protocol.md, Limits). `run_generation` is
`generate` and `demo`'s: a request as the commands take it, and the report they print.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from moeswarm.errors import MoeSwarmError
from moeswarm.generation.draft_names import DEFAULT_DRAFT
from moeswarm.generation.drafters import Drafter
from moeswarm.generation.prompt import check_context, prompt_tokens
from moeswarm.generation.report import GenerationReport, SwarmFacts
from moeswarm.generation.request import GenerationRequest
from moeswarm.generation.result import GenerationResult
from moeswarm.generation.sampling import SamplingParams, make_generator
from moeswarm.sources.loading import load_local
from moeswarm.sources.source import ModelSource
from moeswarm.sources.tokenizer import TextCodec, load_text_codec
from moeswarm.engine.config import EngineConfig
from moeswarm.engine.engine import Engine
from moeswarm.engine.job import Delta, Event, Failed, Finished, Job, Rewind
from moeswarm.engine.metrics import UnrecordedMetrics
from moeswarm.engine.whole_model import WholeModel
from moeswarm.swarm import Swarm

PREFILL_CHUNK = 256  # prompt tokens per forward: 256 x top-8 x 2048 float32 values stay within a worker's reply bound
GREEDY = SamplingParams()


def generate(backbone: Swarm | WholeModel, prompt: list[int], max_new_tokens: int, speculate: int | None = 0,
             reference: torch.nn.Module | None = None, *, codec: TextCodec | None = None,
             sampling: SamplingParams = GREEDY, stops: tuple[str, ...] = (), draft: str = DEFAULT_DRAFT,
             drafter: Callable[[], Drafter] | None = None, adaptive: bool = False,
             on_event: Callable[[Event], None] | None = None) -> GenerationResult:
    """Up to `max_new_tokens` tokens after `prompt`, through the engine, alone.

    backbone: a swarm, or a WholeModel (a model computing its own experts: the reference outputs).
    reference: a local eager model every step is compared with (the swarm's wire says how: exact or gate).
    codec: its end-of-sequence token ends the generation, its text is what `stops` are looked for in
    (None: token ids only, no end-of-sequence token).
    speculate: the most drafts per step (None: the default, on where a step has remote trips: engine/speculation.py).
    draft, drafter: where up to `speculate` drafts per step come from (drafter: a maker of one; default `draft`'s).
    adaptive: each step's drafts counted by the goodput rule under `speculate` (else up to it every step).
    on_event: each of the engine's events for the request (Delta, Rewind, ...), as they come.
    A failed step raises what failed it when that is a MoeSwarmError (a holder lost: WorkerError,
    ExpertsUnavailable), else MoeSwarmError with its one-line message.
    """
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    config = backbone.model.config
    codec = codec or TextCodec("token ids only", None, config.vocab_size)
    positions = getattr(config, "max_position_embeddings", None) or len(prompt) + max_new_tokens + 1
    chunk = min(len(prompt), PREFILL_CHUNK)
    draft = draft if speculate != 0 else DEFAULT_DRAFT  # without drafts the drafter is moot (the engine refuses another)
    engine_config = EngineConfig(positions, max_batch=1, speculate=speculate, prefill_chunk=chunk,
                                 step_tokens=max(256, chunk), cache_slots=0, draft=draft, keep_accounting=True,
                                 adaptive=adaptive)
    outcome = _Outcome(on_event)
    engine = Engine(backbone, codec, engine_config, UnrecordedMetrics(), reference, drafter)
    try:
        tally = engine.run(Job(list(prompt), max_new_tokens, sampling, outcome.take, stops=tuple(stops)))
    finally:
        engine.close()
    if outcome.failure is not None:
        cause = outcome.failure.cause
        raise cause if isinstance(cause, MoeSwarmError) else MoeSwarmError(outcome.failure.message)
    return GenerationResult(list(prompt), list(tally.tokens), tally.steps, tally.drafted, tally.accepted,
                            tally.branches, tally.drafted_all, tally.seconds, tally.draft_seconds,
                            tally.prefill_seconds, outcome.finish_reason, engine.check, outcome.text,
                            engine.config.speculate, tally.drafts.summary() if tally.drafts is not None else {})


def check_request(source: ModelSource, request: GenerationRequest) -> None:
    """The prompt checks `run_generation` makes, made early: they need only the config and tokenizer."""
    codec = load_text_codec(source, source.config.vocab_size)
    check_context(source.config, len(prompt_tokens(codec, request.prompt, request.prompt_ids)), request.max_new_tokens)


def run_generation(swarm: Swarm, request: GenerationRequest,
                   on_event: Callable[[Event], None] | None = None) -> GenerationReport:
    """`request` on `swarm` (checked against a local eager run with request.check_local), reported."""
    codec = load_text_codec(swarm.source.path, swarm.model.config.vocab_size)
    prompt = prompt_tokens(codec, request.prompt, request.prompt_ids)
    check_context(swarm.model.config, len(prompt), request.max_new_tokens)
    reference = load_local(swarm.source) if request.check_local else None
    swarm.reset_accounting()
    sampling = request.sampling
    if not sampling.greedy and sampling.seed is None:  # draw the seed here, to report it
        sampling = replace(sampling, seed=make_generator(None).initial_seed())
    result = generate(swarm, prompt, request.max_new_tokens, request.speculate, reference, codec=codec,
                      sampling=sampling, stops=request.stops, draft=request.draft,
                      adaptive=request.speculate_policy == "goodput", on_event=on_event)
    return GenerationReport(result, replace(request, sampling=sampling, speculate=result.speculate),
                            SwarmFacts.of(swarm, codec.name), swarm.accounting())


class _Outcome:
    """What the request's events say: its text, how it ended (each event passed on as it comes)."""

    def __init__(self, on_event: Callable[[Event], None] | None):
        self.on_event = on_event
        self.text = ""
        self.finish_reason: str | None = None
        self.failure: Failed | None = None

    def take(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.text += event.text
        elif isinstance(event, Rewind):  # a liar's steps undone: their text is taken back
            self.text = self.text[: event.text]
        elif isinstance(event, Finished):
            self.finish_reason = event.reason
        elif isinstance(event, Failed):
            self.failure = event
        if self.on_event is not None:
            self.on_event(event)
