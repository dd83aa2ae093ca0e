"""`moeswarm serve`'s OpenAI surface with the official openai client: log-probabilities and echo
(compared with torch.equal to a local forward of the bundled model), n and prompt lists, token-id
prompts, penalties and min_p, the bundled chat template, tokenize, errors in OpenAI's shape, the
HTTP limits (429, deadlines, connection cap, abandoned requests), and structured output and tool
calls (validated against their schemas).

One server: the bundled model on two real workers, with --speculate 3 (log-probabilities must not
change with it), started with --port 0 (the port it prints is the one it serves on), holding a
quarter of the experts itself by --local-experts 25% with no --profile (the one the bundled model
ships ranks them).
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest
import torch

from moeswarm.bundled import TRAINED
from moeswarm.generation.sampling import SamplingParams, log_probs, penalize
from moeswarm.forward.stepper import Stepper
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.serve.grammar import Grammars
from moeswarm_bench.serve_process import ServeProcess

PROMPT = "def add(a, b):\n"
MAX_BATCH, MAX_QUEUE, MAX_CONNECTIONS = 4, 4, 12


class PortZeroServer(ServeProcess):
    """serve --port 0: the URL is the one it prints."""

    def __init__(self, model: str, workers: list[str], *flags: str):
        command = [sys.executable, "-m", "moeswarm.cli", "serve", "--model", model, "--workers", ",".join(workers),
                   "--port", "0", "--threads", "1", "--log-level", "warning", *flags]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        assert line.startswith("moeswarm serve: listening on http://127.0.0.1:"), line
        self.url = line.split(" on ", 1)[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def server(trained_workers):
    process = PortZeroServer(str(TRAINED), trained_workers, "--speculate", "3", "--model-name", "pymoe", "--local-experts", "25%",
                             "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE),
                             "--max-connections", str(MAX_CONNECTIONS), "--header-timeout", "1.5",
                             "--body-timeout", "1.5", "--cors-origins", "http://app.example")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(trained_local):
    return trained_local  # conftest: the bundled model and its codec


def _greedy_with_logprobs(model, prompt: list[int], count: int, eos: int, params=SamplingParams()):
    """The reference: the prompt in one forward, then one token per forward; (tokens, logprob rows [V] each)."""
    stepper, tokens, rows = Stepper(model), [], []
    logits = stepper.forward(prompt)[-1]
    context = list(prompt)
    for _ in range(count):
        token = int(penalize(logits, context, len(tokens), params).argmax())
        tokens.append(token)
        rows.append(log_probs(logits))
        context.append(token)
        if token == eos:
            break
        logits = stepper.forward([token])[-1]
    return tokens, rows


def _f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# -- log-probabilities -----------------------------------------------------------------------------------

def test_echo_scores_token_prompts_as_lm_eval_asks_bit_for_bit(client, local):
    """lm-evaluation-harness's loglikelihood request: token-id prompts, a batch of 2, max_tokens 1, echo."""
    model, codec = local
    prompts = [codec.encode("def add(a, b):\n    return a + b\n"), codec.encode("import os\nimport sys\n")]
    reply = client.completions.create(model="pymoe", prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    for ids, choice in zip(prompts, reply.choices):
        rows = log_probs(Stepper(model).forward(ids))  # [n, V]
        got = choice.logprobs
        assert len(got.token_logprobs) == len(ids) + 1 and got.token_logprobs[0] is None and got.top_logprobs[0] is None
        expected = torch.stack([rows[i, ids[i + 1]] for i in range(len(ids) - 1)] + [rows[-1].max()])
        assert torch.equal(_f32(got.token_logprobs[1:]), expected)
        best = [codec.decode([int(rows[i].argmax())]) for i in range(len(ids))]
        assert [max(top, key=top.get) for top in got.top_logprobs[1:]] == best
        assert got.tokens[: len(ids)] == [codec.decode([t]) for t in ids]
        assert choice.text.startswith(codec.decode(ids))


def test_max_tokens_0_scores_the_prompt_only(client, local):
    model, codec = local
    ids = codec.encode(PROMPT)
    reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=0, logprobs=3, echo=True)
    rows = log_probs(Stepper(model).forward(ids))
    choice = reply.choices[0]
    assert choice.text == PROMPT and reply.usage.completion_tokens == 0
    assert torch.equal(_f32(choice.logprobs.token_logprobs[1:]), torch.stack([rows[i, ids[i + 1]] for i in range(len(ids) - 1)]))
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs[1:])


def test_generated_logprobs_equal_a_local_forward_despite_speculation(client, local):
    model, codec = local
    for _ in range(2):  # the second time the prompt is in the prefix cache: the values must not change
        reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=10, logprobs=2, temperature=0)
        tokens, rows = _greedy_with_logprobs(model, codec.encode(PROMPT), 10, codec.eos_token_id)
        got = reply.choices[0].logprobs
        assert got.tokens == [codec.decode([t]) for t in tokens]
        assert torch.equal(_f32(got.token_logprobs), torch.stack([row[t] for t, row in zip(tokens, rows)]))
        for top, row in zip(got.top_logprobs, rows):
            values, ids = row.topk(2)
            assert list(top.values()) == values.tolist() and list(top) == [codec.decode([i]) for i in ids.tolist()]


def test_streamed_echo_and_logprobs_equal_the_whole_answer(client):
    options = dict(model="pymoe", prompt=PROMPT, max_tokens=4, logprobs=1, echo=True, temperature=0)
    whole = client.completions.create(**options).choices[0]
    tokens, values, text = [], [], ""
    for chunk in client.completions.create(stream=True, **options):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert (text, tokens, values) == (whole.text, whole.logprobs.tokens, whole.logprobs.token_logprobs)


def test_chat_logprobs_with_the_bundled_template(client, local):
    model, codec = local
    messages = [{"role": "user", "content": "a function that adds two numbers"}]
    reply = client.chat.completions.create(model="pymoe", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    prompt = codec.encode(codec.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert codec.decode(prompt) == "# user: a function that adds two numbers\n# assistant:\n"
    tokens, rows = _greedy_with_logprobs(model, prompt, 6, codec.eos_token_id)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [codec.decode([t]) for t in tokens]
    assert torch.equal(_f32([c.logprob for c in content]), torch.stack([row[t] for t, row in zip(tokens, rows)]))
    assert all([t.logprob for t in c.top_logprobs] == row.topk(3).values.tolist() for c, row in zip(content, rows))
    stream = client.chat.completions.create(model="pymoe", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]


# -- several completions and prompts --------------------------------------------------------------------

def test_n_choices_with_a_seed(client):
    # speculate 0: with drafts, which random draws a seed's sampling consumes depends on what was drafted
    options = dict(model="pymoe", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, extra_body={"speculate": 0})
    many = client.completions.create(n=3, **options)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == client.completions.create(**options).choices[0].text  # choice 0 uses the seed itself
    assert len({c.text for c in many.choices}) > 1  # each choice its own seed
    assert many.usage.prompt_tokens == len(load_text_codec(TRAINED, 4096).encode(PROMPT))  # the prompt once
    assert 3 <= many.usage.completion_tokens <= 24
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(n=3, stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in many.choices]


def test_a_list_of_text_prompts_answers_each_as_alone(client):
    prompts = ["import os\n", "class Stack:\n"]
    together = client.completions.create(model="pymoe", prompt=prompts, max_tokens=6, temperature=0)
    alone = [client.completions.create(model="pymoe", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    assert [c.text for c in together.choices] == alone


# -- sampling options ------------------------------------------------------------------------------------

def test_penalties_change_greedy_tokens_as_the_reference_does(client, local):
    model, codec = local
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0)
    reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=20, temperature=0, logprobs=0,
                                      presence_penalty=1.0, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.5})
    tokens, _ = _greedy_with_logprobs(model, codec.encode(PROMPT), 20, codec.eos_token_id, params)
    plain, _ = _greedy_with_logprobs(model, codec.encode(PROMPT), 20, codec.eos_token_id)
    assert reply.choices[0].logprobs.tokens == [codec.decode([t]) for t in tokens]
    assert tokens != plain  # the penalties did change something, so the comparison means something


def test_logit_bias_pushes_a_token_and_bans_another(client, local):
    _, codec = local
    (pushed,) = codec.encode(" return")
    reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=3, temperature=0,
                                      logit_bias={str(pushed): 100})
    assert reply.choices[0].text == " return" * 3
    plain = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = codec.encode(plain.choices[0].logprobs.tokens[0])[0]
    banned = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=1, logit_bias={"99999": 1})


def test_min_p_1_keeps_only_the_likeliest_token(client):
    sampled = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=10, temperature=1.5, seed=5,
                                        extra_body={"min_p": 1.0})
    greedy = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=10, temperature=0)
    assert sampled.choices[0].text == greedy.choices[0].text


# -- the rest of the surface -----------------------------------------------------------------------------

def test_tokenize_detokenize_and_models_retrieve(server, client, local):
    _, codec = local
    tokens = httpx.post(server.url + "/tokenize", json={"content": PROMPT}).json()["tokens"]
    assert tokens == codec.encode(PROMPT)
    pieces = httpx.post(server.url + "/tokenize", json={"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens and "".join(p["piece"] for p in pieces) == PROMPT
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json() == {"content": PROMPT}
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert client.models.retrieve("pymoe").id == "pymoe"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_context_length_exceeded_in_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=1000)
    assert error.value.code == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in error.value.message


@pytest.mark.parametrize("body, param", [
    ('{"model": "pymoe", "prompt": "x\\ud800y"}', "prompt"),
    ('{"model": "pymoe", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    (b'{"model": "pymoe", "prompt": "x\xff"}', None),
])
def test_broken_text_is_a_400_in_openai_shape(server, body, param):
    path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
    response = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error" and response.json()["error"]["param"] == param


def test_cors_preflight_for_an_allowed_origin(server):
    preflight = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


# -- limits ----------------------------------------------------------------------------------------------

def test_more_jobs_than_slots_and_queue_get_429_with_retry_after(server):
    body = {"model": "pymoe", "prompt": PROMPT, "max_tokens": 2, "n": MAX_BATCH + MAX_QUEUE + 1}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_an_abandoned_whole_request_frees_its_slot_at_once(server):
    before = server.metrics().get("moeswarm_generated_tokens_total", 0.0)
    body = json.dumps({"model": "pymoe", "prompt": PROMPT, "max_tokens": 240, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while not server.metrics().get("moeswarm_active_sequences") and time.monotonic() < deadline:
            time.sleep(0.02)
    gone = time.monotonic()
    while server.metrics().get("moeswarm_active_sequences") and time.monotonic() < gone + 10:
        time.sleep(0.02)
    assert server.metrics().get("moeswarm_active_sequences") == 0
    generated = server.metrics().get("moeswarm_generated_tokens_total", 0.0) - before
    assert generated < 200, generated  # cut short, not run to its 240 tokens


def test_slow_headers_and_bodies_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port)) as slow_headers, \
            socket.create_connection(("127.0.0.1", server.port)) as slow_body:
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\":")
        started = time.monotonic()
        for connection in (slow_headers, slow_body):
            connection.settimeout(10)
            while connection.recv(4096):  # until the server closes it (a 4xx may come first)
                pass
        assert time.monotonic() - started < 6  # 1.5 s for the headers, 1.5 s more for the body


def test_connections_past_the_cap_are_closed(server, client):
    time.sleep(2)  # the idle connections earlier tests left open are closed by the header deadline
    opened = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS + 4)]
    try:
        time.sleep(0.3)  # well within the 1.5 s header deadline
        readable, _, _ = select.select(opened, [], [], 0)
        assert len(readable) == 4 and all(connection.recv(1) == b"" for connection in readable)
        assert readable == opened[-4:]
    finally:
        for connection in opened:
            connection.close()
    time.sleep(0.2)
    assert client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


# -- structured output and tools -------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "ok", "size", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


def test_json_schema_answers_match_the_schema(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    reply = client.chat.completions.create(model="pymoe", messages=ASK, max_tokens=60, temperature=0.8, seed=1, n=4,
                                           response_format=response_format, extra_body={"speculate": 0})
    assert len(reply.choices) == 4
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    stream = client.chat.completions.create(model="pymoe", messages=ASK, max_tokens=60, temperature=0.8, seed=1,
                                            response_format=response_format, stream=True, extra_body={"speculate": 0})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content


def test_drafts_do_not_change_a_constrained_answer(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answers = [client.chat.completions.create(model="pymoe", messages=ASK, max_tokens=60, temperature=0,
                                              response_format=response_format, extra_body={"speculate": k})
               .choices[0].message.content for k in (0, 3)]
    assert answers[0] == answers[1]
    jsonschema.validate(json.loads(answers[0]), PERSON)


def test_json_object_answers_are_held_to_json(client, local):
    _, codec = local
    reply = client.chat.completions.create(model="pymoe", messages=ASK, max_tokens=40, temperature=0,
                                           response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix the grammar of a JSON object accepts
        grammars = Grammars(codec.tokenizer, 4096)
        constraint = grammars.constraint(grammars.json_schema({"type": "object"}))
        tokens = codec.encode(text)
        assert text.startswith("{") and constraint.valid_drafts(tokens) == tokens


@pytest.mark.parametrize("tool_choice, name", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
])
def test_a_required_or_named_tool_choice_gives_a_call(client, tool_choice, name):
    tools = [WEATHER, TIME]
    reply = client.chat.completions.create(model="pymoe", messages=ASK, max_tokens=60, temperature=0, tools=tools,
                                           tool_choice=tool_choice, extra_body={"speculate": 0})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and (name is None or call.function.name == name)
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    stream = client.chat.completions.create(model="pymoe", messages=ASK, max_tokens=60, temperature=0, tools=tools,
                                            tool_choice=tool_choice, stream=True, extra_body={"speculate": 0})
    chunks = [c.choices[0] for c in stream if c.choices]
    calls = [d for c in chunks if c.delta.tool_calls for d in c.delta.tool_calls]
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == \
        [(0, call.function.name, call.function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls"


def test_tool_choice_none_answers_text_from_a_prompt_that_shows_the_tools(client, local):
    model, codec = local
    reply = client.chat.completions.create(model="pymoe", messages=ASK, max_tokens=8, temperature=0, tools=[WEATHER],
                                           tool_choice="none")
    assert reply.choices[0].message.tool_calls is None
    prompt = codec.encode(codec.tokenizer.apply_chat_template(ASK, tools=[WEATHER], tokenize=False,
                                                              add_generation_prompt=True))
    assert codec.decode(prompt).startswith('# tool: get_weather(city, celsius)\n# user: ')
    tokens, _ = _greedy_with_logprobs(model, prompt, 8, codec.eos_token_id)
    assert reply.choices[0].message.content == codec.decode([t for t in tokens if t != codec.eos_token_id])


@pytest.mark.parametrize("body, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool is named"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "the schema cannot be used"),
])
def test_bad_structured_requests_are_400s(server, body, words):
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": "pymoe", "messages": ASK} | body)
    assert response.status_code == 400 and words in response.json()["error"]["message"]
