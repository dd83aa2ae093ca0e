"""The routes beside chat and completions, with the official openai client against a real serve on
the bundled model and two workers: /v1/responses (text, items, instructions, tool calls and their
outputs, previous_response_id, streaming events in OpenAI's order), /v1/embeddings (bit-identical
to the local model's pooled hidden states) and vLLM's /tokenize shapes; and tool_choice auto on
/v1/responses in-process over an engine that answers with a given text."""

from __future__ import annotations

import base64
import json

import httpx
import numpy
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from moeswarm.serve.api import ServeState, create_app
from moeswarm.serve.embeddings import pooled
from moeswarm.engine.job import Delta, Finished

TOOLS = [{"type": "function", "name": "get_time", "description": "the time in a zone",
          "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                         "additionalProperties": False}}]


@pytest.fixture(scope="module")
def client(trained_serve):
    return openai.OpenAI(base_url=trained_serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_text_response_equals_the_chat_answer(client):
    chat = client.chat.completions.create(model="pymoe", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "def add(a, b):"}])
    reply = client.responses.create(model="pymoe", instructions="Answer briefly.", input="def add(a, b):",
                                    temperature=0, max_output_tokens=12)
    assert reply.output_text == chat.choices[0].message.content and reply.output_text
    assert reply.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    as_items = client.responses.create(model="pymoe", temperature=0, max_output_tokens=12, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "def add(a, b):"}]}])
    assert as_items.output_text == reply.output_text


def test_a_tool_call_its_output_and_a_chained_response(client):
    several = client.responses.create(model="pymoe", input="What time is it in UTC?", tools=TOOLS,
                                      tool_choice="required", temperature=0, max_output_tokens=60)
    assert several.output and {item.type for item in several.output} == {"function_call"}
    assert len({item.call_id for item in several.output}) == len(several.output)  # one item per call
    called = client.responses.create(model="pymoe", input="What time is it in UTC?", tools=TOOLS,
                                     tool_choice="required", parallel_tool_calls=False, temperature=0)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "noon"}
    chained = client.responses.create(model="pymoe", previous_response_id=called.id, input=[output], tools=TOOLS,
                                      temperature=0, max_output_tokens=10)
    whole = client.responses.create(model="pymoe", tools=TOOLS, temperature=0, max_output_tokens=10, input=[
        {"role": "user", "content": "What time is it in UTC?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, output])
    assert chained.output_text == whole.output_text  # the chain is the conversation sent whole
    assert chained.output[0].type == "message"
    with pytest.raises(openai.BadRequestError, match="previous response 'resp_gone' is not found"):
        client.responses.create(model="pymoe", previous_response_id="resp_gone", input="hi")
    kept = httpx.get(str(client.base_url) + f"responses/{called.id}").json()
    assert kept["output"][0]["call_id"] == call.call_id


def test_streamed_events_come_in_openais_order(client):
    whole = client.responses.create(model="pymoe", input="def add(a, b):", temperature=0, max_output_tokens=8)
    events = list(client.responses.create(model="pymoe", input="def add(a, b):", temperature=0,
                                          max_output_tokens=8, stream=True))
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", f"response.{whole.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(deltas) == events[-1].response.output_text == whole.output_text
    called = list(client.responses.create(model="pymoe", input="Time in UTC?", tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, stream=True))
    assert [event.type for event in called][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert called[-1].response.output[0].arguments == called[3].delta


@pytest.mark.parametrize("body, named", [
    ({"input": "hi", "frobnicate": 1}, "frobnicate: not a field of the Responses API"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]: items of type input_image"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]: web_search tools are not supported"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include: reasoning.encrypted_content"),
])
def test_what_is_not_built_is_refused_by_name(trained_serve, body, named):
    reply = httpx.post(trained_serve.url + "/v1/responses", json={"model": "pymoe"} | body, timeout=30)
    assert reply.status_code == 400 and named in reply.json()["error"]["message"]


def test_embeddings_are_the_local_models_pooled_hidden_states(client, trained_local):
    model, codec = trained_local
    texts = ["def add(a, b):", "hello world"]
    reply = client.embeddings.create(model="pymoe", input=texts, encoding_format="base64")
    assert [d.index for d in reply.data] == [0, 1] and reply.usage.prompt_tokens == sum(len(codec.encode(t)) for t in texts)
    for text, data in zip(texts, reply.data):
        served = torch.from_numpy(numpy.frombuffer(base64.b64decode(data.embedding), dtype="<f4").copy())
        assert torch.equal(served, pooled(model, codec.encode(text)))  # the swarm's forward, bit for bit
        assert abs(float(served.norm()) - 1) < 1e-5
    floats = client.embeddings.create(model="pymoe", input=codec.encode(texts[0]))
    assert len(floats.data[0].embedding) == model.config.hidden_size
    assert torch.equal(torch.tensor(floats.data[0].embedding, dtype=torch.float32),
                       pooled(model, codec.encode(texts[0])))
    with pytest.raises(openai.BadRequestError, match="dimensions: this model's embeddings have"):
        client.embeddings.create(model="pymoe", input="x", dimensions=3)


def test_tokenize_takes_vllms_shapes_and_llama_servers(trained_serve, trained_local):
    _, codec = trained_local
    url = trained_serve.url + "/tokenize"
    prompt = httpx.post(url, json={"model": "pymoe", "prompt": "def add(a, b):"}).json()
    assert prompt["tokens"] == codec.encode("def add(a, b):") and prompt["count"] == len(prompt["tokens"])
    assert prompt["max_model_len"] > 0
    chat = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}).json()
    rendered = codec.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=True)
    assert chat["tokens"] == codec.encode(rendered) and "".join(chat["token_strs"]) == rendered
    assert httpx.post(url, json={"content": "def add(a, b):"}).json() == {"tokens": codec.encode("def add(a, b):")}
    neither = httpx.post(url, json={"text": "hi"})
    assert neither.status_code == 400 and "content" in neither.json()["error"]["message"]


class SayingEngine:
    """Answers every job with `text`, a few characters per event (the bundled model never writes a call
    unconstrained: tool_choice auto is checked here, in-process)."""

    class config:
        max_batch = 4

    queue_depth = active = 0
    problems: list[str] = []
    text = ""

    def submit(self, job) -> None:
        for at in range(0, len(self.text), 7):
            job.emit(Delta(self.text[at : at + 7], (5,)))
        job.emit(Finished("stop", len(job.prompt), 3, 0))


@pytest.mark.parametrize("text, called", [('{"name": "get_time", "arguments": {"zone": "UTC"}}', True),
                                          ("{not a call", False), ("the time is noon", False)])
def test_auto_reads_a_call_only_when_the_answer_is_one(trained_local, text, called):
    _, codec = trained_local
    state = ServeState("m", codec=codec, context=256, vocab_size=4096)
    state.engine = SayingEngine()
    state.engine.text = text
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=TestClient(create_app(state)),
                           max_retries=0)
    whole = client.responses.create(model="m", input="time?", tools=TOOLS)
    events = list(client.responses.create(model="m", input="time?", tools=TOOLS, stream=True))
    for output in (whole.output, events[-1].response.output):
        (item,) = output
        if called:
            assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_time", {"zone": "UTC"})
        else:
            assert item.type == "message" and item.content[0].text == text
    deltas = "".join(e.delta for e in events if e.type in ("response.output_text.delta",
                                                            "response.function_call_arguments.delta"))
    assert deltas == (events[-1].response.output[0].arguments if called else text)
