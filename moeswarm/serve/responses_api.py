"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API over the chat machinery.

The input becomes chat messages (serve/responses_input.py), rendered by the chat template, and
runs as one chat job would (tools, tool_choice and structured output as /v1/chat/completions has
them: serve/tools.py). The answer is one output item: a `message` with one `output_text` part, or
a `function_call` (arguments as a JSON string, a fresh `call_id`). A `length` end is status
`incomplete` with incomplete_details.reason `max_output_tokens`.

Streamed, the events are OpenAI's, each with its `sequence_number`: response.created,
response.in_progress, then response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done (a call: response.output_item.added,
response.function_call_arguments.delta, .done, response.output_item.done), and
response.completed (or response.incomplete). A request that fails mid-stream ends with an `error`
event, response.failed and `data: [DONE]`.

`previous_response_id`: a stored response's conversation (its input without its instructions, then
its output) goes before the new input, as OpenAI chains them. Responses are kept in memory, the
last STORED of them (`store: false`: not kept); an id no longer kept is a 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from moeswarm.errors import MoeSwarmError, one_line, printable
from moeswarm.generation.sampling import SamplingParams
from moeswarm.engine.job import Delta, Failed, Finished, Rewind
from moeswarm.serve.responses import APIError, Shapes
from moeswarm.serve.responses_input import ResponsesRequest, chat_messages
from moeswarm.serve.runs import ABANDONED, Ask, Prompt, Run
from moeswarm.serve.state import RETRY_AFTER_S, constraint_maker, engine_for, job_limits
from moeswarm.serve.tools import call_schemas, most_calls, template_tools

STORED = 256  # responses kept for previous_response_id and GET /v1/responses/{id}


class ResponseStore:
    """The last `size` responses: each one's body and its conversation as chat messages."""

    def __init__(self, size: int = STORED):
        self.size = size
        self.kept: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> None:
        self.kept[body["id"]] = (body, conversation)
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        if response_id not in self.kept:
            raise APIError(400, f"previous response {printable(response_id, 80)!r} is not found: this server keeps "
                                f"its last {self.size} stored responses", code="previous_response_not_found",
                           param="previous_response_id")
        return self.kept[response_id]


def add_response_routes(app: FastAPI, state) -> None:
    """Register the Responses API on `app` (state: serve/state.py ServeState)."""
    from moeswarm.serve.chat import NoChatTemplate, chat_prompt

    store = ResponseStore()

    @app.get("/v1/responses/{response_id}")
    async def stored(response_id: str):
        if response_id not in store.kept:
            raise APIError(404, f"no stored response {printable(response_id, 80)!r}", code="not_found")
        return store.kept[response_id][0]

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        engine = engine_for(state, body)
        history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
        try:
            new = chat_messages(body.input, None)
        except ValueError as error:
            raise APIError(400, str(error), param="input") from None
        conversation = history + new
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        tools = body.function_tools()
        try:
            tokens = chat_prompt(state.codec, messages, template_tools(tools))
        except NoChatTemplate as error:
            raise APIError(400, str(error), code="no_chat_template") from None
        except MoeSwarmError as error:
            raise APIError(400, one_line(error), param="input") from None
        mode, most = body.tool_mode(), 0
        if mode not in (None, "auto"):  # a call is due: decoding is held to calls
            schema, field_name, most = call_schemas(tools, mode), "tools", most_calls(mode, body.parallel_tool_calls)
        else:
            form = body.response_format()
            schema, field_name = (form.output_schema if form else None), "text"
        try:
            params = SamplingParams(body.temperature, body.top_p, seed=body.seed)
        except ValueError as error:
            raise APIError(400, one_line(error)) from None
        ask = Ask(params, make_constraint=await constraint_maker(state, schema, field_name, most), tools=tuple(tools),
                  tool_mode=mode)
        limit = body.max_output_tokens if body.max_output_tokens is not None else state.default_max_tokens
        prompt = Prompt(tokens, "", job_limits(state, tokens, limit))
        free = max(0, engine.config.max_batch - engine.active)
        if engine.queue_depth + 1 > state.max_queue + free:
            raise APIError(429, f"the server is busy: {engine.queue_depth} requests wait for a slot (at most "
                                f"{state.max_queue}); retry shortly", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        run = Run([prompt], ask, Shapes(state.model_id, True), lambda token: state.codec.decode([token]),
                  getattr(request.state, "arrived", None))
        shape = ResponseShape(state.model_id, body)
        for job in run.jobs:
            engine.submit(job)
        keep = (lambda done: store.put(done, conversation + output_messages(done))) if body.store else (lambda done: None)
        if body.stream:
            return StreamingResponse(stream(run, shape, keep), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(run, shape, request, keep)


class ResponseShape:
    """The bodies of one response: its id, creation time and echoed settings in every event."""

    def __init__(self, model: str, body: ResponsesRequest):
        self.model, self.body = model, body
        self.id, self.created = f"resp_{uuid.uuid4().hex[:24]}", int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"

    def response(self, status: str, output: list[dict], done: Finished | None = None) -> dict:
        body = self.body
        usage = None
        if done is not None:
            usage = {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
                     "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": done.prompt_tokens + done.completion_tokens}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "instructions": body.instructions, "error": None,
                "incomplete_details": incomplete, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "temperature": body.temperature,
                "top_p": body.top_p, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls is not False, "store": body.store,
                "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "metadata": body.metadata or {}, "usage": usage}

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
                status != "in_progress" else []}

    @staticmethod
    def function_call(call: dict, status: str = "completed") -> dict:
        """An output item calling a tool (call: serve/tools.py's {"name", "arguments"}: a dict, or the
        text written so far of a call cut by max_output_tokens, whose item is then `incomplete`)."""
        arguments = call["arguments"]
        if isinstance(arguments, str):
            status = "incomplete"
        else:
            arguments = json.dumps(arguments, ensure_ascii=False)
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
                "name": call["name"], "arguments": arguments, "status": status}


def output_messages(response: dict) -> list[dict]:
    """A response's output as the chat messages that continue its conversation."""
    messages = []
    for item in response["output"]:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(part["text"] for part in item["content"])})
            continue
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                         "arguments": item["arguments"]}}
        if messages and messages[-1].get("tool_calls"):  # the calls of one answer: one assistant turn
            messages[-1]["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return messages


def _status(done: Finished) -> str:
    return "incomplete" if done.reason == "length" else "completed"


async def whole(run: Run, shape: ResponseShape, request: Request, keep) -> dict | Response:
    text, done = "", None
    watcher = asyncio.create_task(run._watch(request))  # a client that goes away frees the slot
    try:
        while done is None:
            index, event = await run.events.get()
            if index == ABANDONED:
                return Response(status_code=499)
            if isinstance(event, Delta):
                text += event.text
            elif isinstance(event, Rewind):
                text = text[: event.text]
            elif isinstance(event, Finished):
                done = event
            elif isinstance(event, Failed):
                raise APIError(event.status, event.message)
    finally:
        watcher.cancel()
        run.cancel()
    calls = run.calls_in(text, done.reason)
    status = _status(done)
    items = [shape.function_call(call) for call in calls] if calls is not None else [shape.message(text, status)]
    body = shape.response(status, items, done)
    keep(body)
    return body


async def stream(run: Run, shape: ResponseShape, keep):
    number = 0

    def event(kind: str, **fields) -> str:
        nonlocal number
        number += 1
        data = {"type": kind, "sequence_number": number - 1} | fields
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    ids = {"item_id": shape.message_id, "output_index": 0}
    text, kept, opened = "", "", False  # text sent; text held while it may be a call; the message item begun

    def begin_message() -> list[str]:
        nonlocal opened
        opened = True
        return [event("response.output_item.added", output_index=0, item=shape.message("", "in_progress")),
                event("response.content_part.added", content_index=0, **ids,
                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
    try:
        yield event("response.created", response=shape.response("in_progress", []))
        yield event("response.in_progress", response=shape.response("in_progress", []))
        while True:
            index, event_ = await run.events.get()
            if isinstance(event_, Delta):
                if run.held(kept + event_.text):
                    kept += event_.text
                    continue
                piece, kept = kept + event_.text, ""
                if not piece:
                    continue
                for begun in [] if opened else begin_message():
                    yield begun
                text += piece
                yield event("response.output_text.delta", content_index=0, delta=piece, logprobs=[], **ids)
            elif isinstance(event_, Finished):
                status = _status(event_)
                calls = run.calls_in(kept, event_.reason) if kept else None
                items = [shape.function_call(call) for call in calls or ()]
                for at, item in enumerate(items):
                    begun = item | {"arguments": "", "status": "in_progress"}
                    yield event("response.output_item.added", output_index=at, item=begun)
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                name=item["name"], arguments=item["arguments"])
                    yield event("response.output_item.done", output_index=at, item=item)
                if calls is None:
                    for begun in begin_message() if kept and not opened else []:
                        yield begun
                    if kept:
                        text += kept
                        yield event("response.output_text.delta", content_index=0, delta=kept, logprobs=[], **ids)
                    item = shape.message(text, status)
                    if opened:
                        yield event("response.output_text.done", content_index=0, text=text, logprobs=[], **ids)
                        yield event("response.content_part.done", content_index=0, part=item["content"][0], **ids)
                        yield event("response.output_item.done", output_index=0, item=item)
                    items = [item] if opened else []
                body = shape.response(status, items, event_)
                keep(body)
                yield event("response.completed" if status == "completed" else "response.incomplete", response=body)
                break
            elif isinstance(event_, (Failed, Rewind)):
                message = event_.message if isinstance(event_, Failed) else \
                    "a worker was caught lying after this answer was streamed in part: the answer is withdrawn; ask again"
                yield event("error", code="server_error", message=message, param=None)
                failed = shape.response("failed", []) | {"error": {"code": "server_error", "message": message}}
                yield event("response.failed", response=failed)
                break
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()

