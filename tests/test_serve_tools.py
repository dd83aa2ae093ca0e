"""tool_choice "auto": an answer that is exactly a call is read as one, anything else stays text,
streamed or not. The HTTP side runs in-process over a fake engine that answers with a given text
(the bundled model itself never writes a call unconstrained; test_serve_api.py covers the
constrained modes on the real model)."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from moeswarm.bundled import TRAINED
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.serve.api import ServeState, create_app
from moeswarm.engine.job import Delta, Finished

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
CALL = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


class SayingEngine:
    """Answers every job with `text`, a few characters per event."""

    class config:
        max_batch = 4

    queue_depth = active = 0
    problems: list[str] = []
    text = ""
    reason = "stop"

    def submit(self, job) -> None:
        for at in range(0, len(self.text), 7):
            job.emit(Delta(self.text[at : at + 7], (5,)))
        job.emit(Finished(self.reason, len(job.prompt), 3, 0))


@pytest.fixture(scope="module")
def served():
    state = ServeState("m", codec=load_text_codec(TRAINED, 4096), context=256, vocab_size=4096)
    state.engine = SayingEngine()
    http = TestClient(create_app(state))
    return state.engine, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


@pytest.mark.parametrize("text, called", [(CALL, True), ("  " + CALL, True), ("{not a call", False),
                                          ('{"name": "other", "arguments": {}}', False), ("the time is noon", False)])
def test_auto_reads_a_call_only_when_the_answer_is_one(served, text, called):
    engine, client = served
    engine.text, engine.reason = text, "stop"
    messages = [{"role": "user", "content": "time?"}]
    reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="auto")
    choice = reply.choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                                     stream=True) if c.choices]
    deltas = [d for c in streamed if c.delta.tool_calls for d in c.delta.tool_calls]
    if called:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert (choice.message.tool_calls[0].function.name, json.loads(choice.message.tool_calls[0].function.arguments)) \
            == ("get_time", {"zone": "UTC"})
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_time", {"zone": "UTC"})]
        assert streamed[-1].finish_reason == "tool_calls"
    else:
        assert choice.finish_reason == "stop" and choice.message.content == text and choice.message.tool_calls is None
        assert deltas == [] and "".join(c.delta.content or "" for c in streamed) == text


def _both(client, **extra):
    messages = [{"role": "user", "content": "time?"}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **extra).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                                     stream=True, **extra) if c.choices]
    return whole, streamed


def test_parallel_calls_are_read_as_several_calls_streamed_and_whole(served):
    engine, client = served
    engine.text, engine.reason = CALL + "\n" + CALL.replace("UTC", "CET") + "\n", "stop"
    whole, streamed = _both(client)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    zones = [json.loads(call.function.arguments)["zone"] for call in whole.message.tool_calls]
    assert zones == ["UTC", "CET"]
    deltas = [d for c in streamed if c.delta.tool_calls for d in c.delta.tool_calls]
    assert [(d.index, json.loads(d.function.arguments)["zone"]) for d in deltas] == [(0, "UTC"), (1, "CET")]
    assert streamed[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_time", "arguments": {"zone": "U', [("get_time", '{"zone": "U')]),
    ('{"name": "get_ti', []),
])
def test_an_auto_answer_cut_while_calling_is_a_cut_call_not_content(served, text, calls):
    engine, client = served
    engine.text, engine.reason = text, "length"
    whole, streamed = _both(client)
    assert whole.finish_reason == "length" and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()] == calls
    assert "".join(c.delta.content or "" for c in streamed) == ""
    assert [(d.function.name, d.function.arguments) for c in streamed for d in c.delta.tool_calls or ()] == calls
    assert [c.finish_reason for c in streamed if c.finish_reason] == ["length"]


def test_an_auto_answer_cut_in_plain_text_stays_text(served):
    engine, client = served
    engine.text, engine.reason = "the time is", "length"
    whole, streamed = _both(client)
    assert (whole.finish_reason, whole.message.content, whole.message.tool_calls) == ("length", "the time is", None)
    assert "".join(c.delta.content or "" for c in streamed) == "the time is"
