"""The OpenAI-compatible HTTP side of `moeswarm serve`: routes, key check, errors, streaming.

The routes never touch the model: they validate a request, turn it into a `Job`, hand it to the
engine, and relay the engine's events (as a whole answer or as server-sent events). Every error
is OpenAI's shape with the right status; nothing a client sends can end the server.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeswarm.errors import MoeSwarmError, one_line, printable
from moeswarm.generation.sampling import SamplingParams
from moeswarm.model.tokenizer import TextCodec
from moeswarm.serve.chat import NoChatTemplate, chat_prompt
from moeswarm.serve.dashboard import PAGE, dashboard_data
from moeswarm.serve.engine import Engine
from moeswarm.serve.job import Delta, Failed, Finished, Job
from moeswarm.serve.metrics import ServeMetrics
from moeswarm.serve.responses import APIError, Shapes, error_body, sse
from moeswarm.serve.schemas import ChatRequest, CompletionRequest, Sampling

MAX_BODY_BYTES = 4 * 1024 * 1024
OPEN_ROUTES = ("/health", "/")  # answered without the API key (the page holds no data: it fetches /v1/dashboard)


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


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="moeswarm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.middleware("http")
    async def guard(request: Request, call_next):
        route = "other"
        try:
            _check_key(state, request)
            _check_body_size(request)
            response = await call_next(request)
            matched = request.scope.get("route")
            route = getattr(matched, "path", route)
        except APIError as error:
            response = JSONResponse(error.body(), status_code=error.status)
        state.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        return JSONResponse(error_body(400, _validation_message(error), param=_validation_param(error)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        message = {404: f"unknown route {request.method} {printable(request.url.path, 200)}",
                   405: f"method {request.method} is not allowed on {printable(request.url.path, 200)}"}
        return JSONResponse(error_body(error.status_code, message.get(error.status_code, str(error.detail))),
                            status_code=error.status_code)

    @app.get("/health")
    async def health():
        engine = state.engine
        if engine is None:
            return JSONResponse({"status": "loading", "problems": [state.loading]}, status_code=503)
        if engine.problems:
            return JSONResponse({"status": "unavailable", "problems": engine.problems}, status_code=503)
        return {"status": "ok", "active": engine.active, "queued": engine.queue_depth}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/v1/dashboard")
    async def dashboard():
        return dashboard_data(state)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "moeswarm"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = _engine(state, body)
        if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], str)):
            text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
            prompt = state.codec.encode(text)
        else:
            prompt = list(body.prompt)
        return await _run(state, engine, request, body, prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        engine = _engine(state, body)
        try:
            prompt = chat_prompt(state.codec, [m.as_template_input() for m in body.messages])
        except NoChatTemplate as error:
            raise APIError(400, str(error), code="no_chat_template") from None
        except MoeSwarmError as error:
            raise APIError(400, one_line(error), param="messages") from None
        return await _run(state, engine, request, body, prompt, body.token_limit, chat=True)

    return app


def _check_key(state: ServeState, request: Request) -> None:
    if state.api_key is None or request.url.path in OPEN_ROUTES:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")


def _check_body_size(request: Request) -> None:
    if request.method != "POST":
        return
    length = request.headers.get("content-length")
    if length is None:
        raise APIError(411, "a POST body needs a Content-Length header")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")


def _engine(state: ServeState, body: Sampling) -> Engine:
    if state.engine is None:
        raise APIError(503, f"not ready: {state.loading}")
    if body.model != state.model_id:
        raise APIError(404, f"model {printable(body.model, 200)!r} does not exist: this server serves "
                            f"{state.model_id!r} (GET /v1/models)", code="model_not_found", param="model")
    return state.engine


def _job_limits(state: ServeState, prompt: list[int], max_tokens: int | None) -> int:
    """max_tokens checked against the context (or the room left in it when not given)."""
    if not prompt:
        raise APIError(400, "the prompt gives no tokens", param="prompt")
    bad = next((t for t in prompt if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range: the vocabulary has {state.vocab_size} ids", param="prompt")
    room = state.context - len(prompt)
    if room < 1:
        raise APIError(400, f"the prompt is {len(prompt)} tokens: this server's context is {state.context} tokens, "
                            "with room for at least one new token", code="context_length_exceeded", param="prompt")
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"max_tokens ({max_tokens}) plus the prompt ({len(prompt)} token{'s' * (len(prompt) != 1)}) exceeds the context "
                            f"({state.context} tokens)", code="context_length_exceeded", param="max_tokens")
    return max_tokens or room


async def _run(state: ServeState, engine: Engine, request: Request, body: Sampling, prompt: list[int],
               max_tokens: int | None, chat: bool):
    limit = _job_limits(state, prompt, max_tokens)
    try:
        params = SamplingParams(body.temperature, body.top_p, body.top_k, body.seed)
    except ValueError as error:
        raise APIError(400, one_line(error)) from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(event) -> None:  # called from the engine's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (the server is stopping)
            pass

    job = Job(prompt, limit, params, emit, body.stops, body.speculate)
    engine.submit(job)
    shapes = Shapes(state.model_id, chat)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(job, events, shapes, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(job, events, shapes, request)


async def _collect(job: Job, events: asyncio.Queue, shapes: Shapes, request: Request):
    text = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Finished):
                return shapes.whole("".join(text), event)
            elif isinstance(event, Failed):
                raise APIError(event.status, event.message)
    finally:
        job.cancelled.set()  # done, failed or abandoned: the engine drops it at its next step if it still runs


async def _stream(job: Job, events: asyncio.Queue, shapes: Shapes, include_usage: bool):
    try:
        if shapes.chat:
            yield sse(shapes.chunk(role=True))
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                if event.text:
                    yield sse(shapes.chunk(event.text))
            elif isinstance(event, Finished):
                yield sse(shapes.chunk(None, event.reason))
                if include_usage:
                    yield sse(shapes.usage_chunk(event))
                break
            elif isinstance(event, Failed):
                yield sse(error_body(event.status, event.message))
                break
        yield sse("[DONE]")
    finally:
        job.cancelled.set()  # a client that went away frees its slot at the engine's next step


def _validation_message(error: RequestValidationError) -> str:
    problems = error.errors()
    if not problems:
        return "invalid request body"
    first = problems[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = first.get("msg", "invalid").removeprefix("Value error, ")
    return printable(f"{where}: {message}" if where else message, 500)


def _validation_param(error: RequestValidationError) -> str | None:
    problems = error.errors()
    if not problems or problems[0].get("type") == "json_invalid":
        return None
    loc = [str(p) for p in problems[0].get("loc", ()) if p != "body"]
    return loc[0] if loc else None
