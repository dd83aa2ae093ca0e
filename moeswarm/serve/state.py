"""What every route of `moeswarm serve` reads: the server's state, and the checks each request
makes against it (ready, the model named, token ids in range, the context's room, a schema's
grammar), raising APIError in OpenAI's shape."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from moeswarm.errors import one_line, printable
from moeswarm.sources.tokenizer import TextCodec
from moeswarm.serve.dashboard import History
from moeswarm.serve.drain import Drain
from moeswarm.engine.engine import Engine
from moeswarm.serve.grammar import GrammarUnavailable, Grammars
from moeswarm.engine.metrics import ServeMetrics
from moeswarm.serve.responses import APIError
from moeswarm.serve.schemas import Sampling

RETRY_AFTER_S = 1  # a busy server's Retry-After


@dataclass
class ServeState:
    model_id: str
    api_key: str | None = None
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    engine: Engine | None = None  # None while loading
    codec: TextCodec | None = None
    context: int = 0
    vocab_size: int = 0
    loading: str = "loading the model"  # what /health says while there is no engine
    default_max_tokens: int | None = None  # serve --max-tokens: a request's max_tokens when it gives none
    max_queue: int = 256  # requests waiting for a slot; past that, 429 with Retry-After
    grammars: Grammars | None = None  # made at the first request for structured output
    history: History = field(default_factory=History)  # the dashboard's time series
    drain: Drain = field(default_factory=Drain)  # requests in flight, and whether the server drains (serve/drain.py)

    def __post_init__(self):
        if not self.metrics.vllm.model_name:
            self.metrics.vllm.name_model(self.model_id)  # vLLM's model_name label


def codec_of(state: ServeState) -> TextCodec:
    if state.codec is None:
        raise APIError(503, f"not ready: {state.loading}")
    return state.codec


def engine_for(state: ServeState, body: Sampling) -> Engine:
    if state.engine is None:
        raise APIError(503, f"not ready: {state.loading}")
    if body.model != state.model_id:
        raise APIError(404, f"model {printable(body.model, 200)!r} does not exist: this server serves "
                            f"{state.model_id!r} (GET /v1/models)", code="model_not_found", param="model")
    return state.engine


def check_ids(state: ServeState, tokens: list[int], param: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range: the vocabulary has {state.vocab_size} ids", param=param)


def job_limits(state: ServeState, prompt: list[int], max_tokens: int | None) -> int:
    """max_tokens checked against the context (or the room left in it when not given)."""
    if not prompt:
        raise APIError(400, "the prompt gives no tokens", param="prompt")
    check_ids(state, prompt, "prompt")
    room = state.context - len(prompt)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        # OpenAI's words, which clients (litellm) map to a context-window error
        asked = len(prompt) + (max_tokens or 1)
        raise APIError(400, f"This model's maximum context length is {state.context} tokens. However, you requested "
                            f"{asked} tokens ({len(prompt)} in the messages, {max_tokens or 1} in the completion). "
                            "Please reduce the length of the messages or completion.",
                       code="context_length_exceeded", param="max_tokens" if room >= 1 else "prompt")
    return room if max_tokens is None else max_tokens


async def constraint_maker(state: ServeState, schema: dict | list[dict] | None, field_name: str, calls: int = 0):
    """What makes each job's grammar constraint (a schema compiled once per request), or None;
    calls: 1 to `calls` lines each matching one of the schemas `schema` (tool calls)."""
    if schema is None:
        return None
    if state.codec.tokenizer is None:
        raise APIError(400, f"{field_name}: structured output needs the model's tokenizer, and this model has none",
                       param=field_name)
    try:
        if state.grammars is None:
            state.grammars = await asyncio.to_thread(Grammars, state.codec.tokenizer, state.vocab_size)
        grammar = await asyncio.to_thread(state.grammars.calls, schema, calls) if calls \
            else await asyncio.to_thread(state.grammars.json_schema, schema)
    except GrammarUnavailable as error:
        raise APIError(400, f"{field_name}: {error}", param=field_name) from None
    except ValueError as error:
        raise APIError(400, f"{field_name}: the schema cannot be used: {printable(one_line(error), 300)}",
                       param=field_name) from None
    grammars = state.grammars
    return lambda: grammars.constraint(grammar)
