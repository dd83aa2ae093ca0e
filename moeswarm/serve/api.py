"""The OpenAI-compatible HTTP side of `moeswarm serve`: routes, key check, errors, streaming.

The routes never touch the model: they validate a request, turn it into a `Job`, hand it to the
engine, and relay the engine's events (as a whole answer or as server-sent events). Every error
is OpenAI's shape with the right status; nothing a client sends can end the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeswarm.errors import MoeSwarmError, one_line, printable
from moeswarm.generation.sampling import SamplingParams
from moeswarm.serve.chat import NoChatTemplate, chat_prompt, echoed
from moeswarm.serve.dashboard import PAGE, SAMPLE_S, dashboard_data
from moeswarm.serve.embeddings import add_embedding_routes
from moeswarm.serve.swarm_page import PAGE as SWARM_PAGE, swarm_data
from moeswarm.engine.engine import Engine
from moeswarm.serve.guard import Guard
from moeswarm.serve.responses import APIError, Shapes, error_body, validation_message, validation_param
from moeswarm.serve.responses_api import add_response_routes
from moeswarm.serve.runs import Ask, Prompt, Run
from moeswarm.serve.schemas import ChatRequest, CompletionRequest, DetokenizeRequest, Sampling
from moeswarm.serve.state import (RETRY_AFTER_S, ServeState, check_ids, codec_of, constraint_maker, engine_for,
                                  job_limits)
from moeswarm.serve.tokenize_api import add_tokenize_route
from moeswarm.serve.tools import call_schemas, most_calls, template_tools

COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for completions


def create_app(state: ServeState, cors_origins: list[str] | None = None) -> FastAPI:
    """The app; cors_origins: the origins a browser page may call it from ("*": any)."""
    app = FastAPI(title="moeswarm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_sampling(state))
    app.state.serve = state

    app.add_middleware(Guard, state=state)
    if cors_origins:  # added after the guard, so it runs first: a preflight needs no key
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        return JSONResponse(error_body(400, validation_message(error), param=validation_param(error)), status_code=400)

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception):  # a bug: still one line in OpenAI's shape, and serving goes on
        return JSONResponse(error_body(500, f"internal error: {printable(one_line(error), 300)}"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        message = {400: "the body cannot be read: it must be JSON in UTF-8",  # FastAPI's parse error (bad UTF-8 too)
                   404: f"unknown route {request.method} {printable(request.url.path, 200)}",
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

    @app.get("/swarm")
    async def swarm_page():
        return FileResponse(SWARM_PAGE, media_type="text/html")

    @app.get("/v1/swarm")
    async def swarm():
        return swarm_data(state)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_id:
            raise APIError(404, f"model {printable(model_id, 200)!r} does not exist: this server serves "
                                f"{state.model_id!r}", code="model_not_found", param="model")
        return _model_card(state)

    add_tokenize_route(app, state)  # llama-server's and vLLM's shapes (serve/tokenize_api.py)
    add_embedding_routes(app, state)  # serve/embeddings.py
    add_response_routes(app, state)  # the Responses API (serve/responses_api.py)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        codec = codec_of(state)
        check_ids(state, body.tokens, "tokens")
        return {"content": codec.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = engine_for(state, body)
        prompts = []
        for given in body.prompts:
            if isinstance(given, str):
                prompts.append(Prompt(state.codec.encode(given), given))
            else:
                prompts.append(Prompt(list(given), state.codec.decode(list(given)) if body.echo else ""))
        limit = body.max_tokens if body.max_tokens is not None else (state.default_max_tokens or COMPLETION_MAX_TOKENS)
        schema = body.response_format.output_schema if body.response_format else None
        ask = Ask(_params(body), body.stops, body.speculate, body.n, body.logprobs, body.echo,
                  await constraint_maker(state, schema, "response_format"), ignore_eos=body.ignore_eos,
                  min_tokens=body.min_tokens, prompt_logprobs=body.prompt_logprobs)
        return await _run(state, engine, request, body, prompts, limit, ask)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        engine = engine_for(state, body)
        messages = [m.as_template_input() for m in body.messages]
        try:
            prompt = chat_prompt(state.codec, messages, template_tools(body.tools), body.add_generation_prompt,
                                 body.continue_final_message)
        except NoChatTemplate as error:
            raise APIError(400, str(error), code="no_chat_template") from None
        except MoeSwarmError as error:
            raise APIError(400, one_line(error), param="messages") from None
        limit = body.token_limit if body.token_limit is not None else state.default_max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        mode, most = body.tool_mode, 0
        if mode not in (None, "auto"):  # a call is due: decoding is held to calls
            schema, field_name, most = call_schemas(body.tools, mode), "tools", most_calls(mode, body.parallel_tool_calls)
        else:
            schema, field_name = (body.response_format.output_schema if body.response_format else None), "response_format"
        ask = Ask(_params(body), body.stops, body.speculate, body.n, logprobs, body.echo,
                  await constraint_maker(state, schema, field_name, most), tuple(body.tools or ()), mode,
                  body.ignore_eos, body.min_tokens, body.prompt_logprobs)
        return await _run(state, engine, request, body, [Prompt(prompt, echoed(messages))], limit, ask)

    return app


def _model_card(state: ServeState) -> dict:
    card = {"id": state.model_id, "object": "model", "created": 0, "owned_by": "moeswarm"}
    if state.context:
        card["max_model_len"] = state.context  # vLLM's field: what clients read the context from
    return card


def _sampling(state: ServeState):
    """The app's lifespan: the dashboard's history sampled while it serves."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def sample_forever():
            while True:
                state.history.sample(state)
                await asyncio.sleep(SAMPLE_S)

        task = asyncio.create_task(sample_forever())
        try:
            yield
        finally:
            task.cancel()

    return lifespan


def _params(body: Sampling) -> SamplingParams:
    try:
        return SamplingParams(body.temperature, body.top_p, body.top_k, body.seed, body.min_p,
                              body.repetition_penalty, body.presence_penalty, body.frequency_penalty, body.bias)
    except ValueError as error:
        raise APIError(400, one_line(error)) from None


async def _run(state: ServeState, engine: Engine, request: Request, body: Sampling, prompts: list[Prompt],
               max_tokens: int | None, ask: Ask):
    prompts = [replace(prompt, max_tokens=job_limits(state, prompt.tokens, max_tokens)) for prompt in prompts]
    if any(ask.min_tokens > prompt.max_tokens for prompt in prompts):
        raise APIError(400, f"min_tokens: {ask.min_tokens} is more than max_tokens "
                            f"({min(p.max_tokens for p in prompts)})", param="min_tokens")
    check_ids(state, [token for token, _ in body.bias], "logit_bias")
    jobs = len(prompts) * body.n
    free = max(0, engine.config.max_batch - engine.active)  # slots a job takes at once, without waiting
    if engine.queue_depth + jobs > state.max_queue + free:
        raise APIError(429, f"the server is busy: {engine.queue_depth} requests wait for a slot (at most "
                            f"{state.max_queue}); retry shortly", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    chat = isinstance(body, ChatRequest)
    run = Run(prompts, ask, Shapes(state.model_id, chat), lambda token: state.codec.decode([token]),
              getattr(request.state, "arrived", None))
    for job in run.jobs:
        engine.submit(job)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(run.stream(include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await run.whole(request)
