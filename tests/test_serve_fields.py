"""Request fields with vLLM's meaning, on the bundled model in-process (the whole model in this
process, an engine checking every step against a local eager copy, the HTTP side through
TestClient): ignore_eos, min_tokens, prompt_logprobs, chat echo, add_generation_prompt and
continue_final_message; and the rule for fields the server does not implement (a 400 naming them).
The replies are compared with a local greedy run of the same model.
"""

from __future__ import annotations

import json

import pytest
import torch
from inprocess_serve import in_process_serve

from moeswarm.bundled import TRAINED
from moeswarm.generation.sampling import log_probs
from moeswarm.forward.stepper import Stepper
from moeswarm.serve.chat import chat_prompt

PROMPT = "def add(a, b):\n"
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def served(trained_local):
    model, codec = trained_local
    with in_process_serve(str(TRAINED), "pymoe", check_local=True, speculate=3) as (http, client, engine):
        yield http, client, model, codec, engine
    assert engine.checked_rows > 0 and engine.mismatched_rows == 0  # every step bit-identical to the local model


def _greedy(model, prompt: list[int], count: int, banned: int | None = None) -> list[int]:
    """The local greedy continuation (with `banned` never chosen)."""
    stepper, tokens = Stepper(model), []
    logits = stepper.forward(prompt)[-1]
    for _ in range(count):
        if banned is not None:
            logits = logits.clone()
            logits[banned] = -torch.inf
        tokens.append(int(logits.argmax()))
        logits = stepper.forward([tokens[-1]])[-1]
    return tokens


def test_ignore_eos_gives_exactly_max_tokens_even_when_end_of_text_is_forced(served):
    http, client, _, codec, _ = served
    push = {str(codec.eos_token_id): 100}  # end of text is every step's likeliest token
    reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=7, temperature=0, logit_bias=push)
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("stop", 1)
    for stream in (False, True):
        body = {"model": "pymoe", "prompt": PROMPT, "max_tokens": 7, "temperature": 0, "logit_bias": push,
                "logprobs": 0, "extra_body": {"ignore_eos": True}}
        reply = client.completions.create(**body, stream=stream) if stream else client.completions.create(**body)
        if stream:
            chunks = list(reply)
            assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
            assert "".join(c.choices[0].text for c in chunks) == ""
            continue
        choice = reply.choices[0]
        assert (choice.finish_reason, reply.usage.completion_tokens, choice.text) == ("length", 7, "")
        assert choice.logprobs.tokens == [codec.decode([codec.eos_token_id])] * 7  # the tokens are there, not shown


def test_min_tokens_holds_end_of_text_and_stop_strings_back(served):
    _, client, model, codec, _ = served
    push = {str(codec.eos_token_id): 100}
    reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=20, temperature=0, logit_bias=push,
                                      extra_body={"min_tokens": 5})
    expected = codec.decode(_greedy(model, codec.encode(PROMPT), 5, banned=codec.eos_token_id))
    assert (reply.choices[0].text, reply.usage.completion_tokens, reply.choices[0].finish_reason) == (expected, 6, "stop")
    plain = codec.decode(_greedy(model, codec.encode(PROMPT), 12))
    stop = plain[:2]  # the output's own start: a stop string found at once without min_tokens
    reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert reply.choices[0].text == ""
    reply = client.completions.create(model="pymoe", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                      extra_body={"min_tokens": 4})
    floor = len(codec.decode(_greedy(model, codec.encode(PROMPT), 3)))
    at = next((i for i in range(len(plain)) if plain.startswith(stop, i) and i + len(stop) > floor), None)
    assert reply.choices[0].text == (plain if at is None else plain[:at])


def test_min_tokens_past_max_tokens_is_a_400_naming_it(served):
    http = served[0]
    response = http.post("/v1/completions", json={"model": "pymoe", "prompt": PROMPT, "max_tokens": 3, "min_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "min_tokens"


def test_prompt_logprobs_are_a_local_forwards_in_vllms_shape(served):
    http, _, model, codec, _ = served
    tokens = codec.encode(PROMPT)
    for route, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
                        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})):
        reply = http.post(route, json={"model": "pymoe", "temperature": 0, "prompt_logprobs": 2} | body).json()
        scored = reply["choices"][0]["prompt_logprobs"] if route == "/v1/completions" else reply["prompt_logprobs"]
        prompt = tokens if route == "/v1/completions" else chat_prompt(codec, CHAT)
        rows = log_probs(Stepper(model).forward(prompt))  # [P, V]
        assert len(scored) == len(prompt) and scored[0] is None
        for i, entry in enumerate(scored[1:]):
            token, row = prompt[i + 1], rows[i]
            assert entry[str(token)]["logprob"] == float(row[token])
            assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
            top = row.topk(2).indices.tolist()
            assert all(str(t) in entry and entry[str(t)]["logprob"] == float(row[t]) for t in top)
            assert len(entry) in (2, 3)
    streamed = http.post("/v1/completions", json={"model": "pymoe", "prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


def test_continue_final_message_and_chat_echo(served):
    http, client, model, codec, _ = served
    messages = CHAT + [{"role": "assistant", "content": "def add("}]
    refused = http.post("/v1/chat/completions", json={"model": "pymoe", "messages": messages, "continue_final_message": True})
    assert refused.status_code == 400 and "add_generation_prompt" in refused.json()["error"]["message"]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    prompt = chat_prompt(codec, messages, add_generation_prompt=False, continue_final_message=True)
    assert codec.decode(prompt).endswith("def add(")  # the assistant's turn left open
    expected = codec.decode(_greedy(model, prompt, 6))
    reply = client.chat.completions.create(model="pymoe", messages=messages, max_tokens=6, temperature=0, extra_body=extra)
    assert reply.choices[0].message.content == "def add(" + expected
    chunks = client.chat.completions.create(model="pymoe", messages=messages, max_tokens=6, temperature=0, stream=True,
                                            extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "def add(" + expected
    reply = client.chat.completions.create(model="pymoe", messages=CHAT, max_tokens=3, temperature=0, extra_body={"echo": True})
    assert reply.choices[0].message.content == codec.decode(_greedy(model, chat_prompt(codec, CHAT), 3))  # a user turn: nothing


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPT, "best_of_n": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "high", "top_a": 0.1}),
])
def test_unknown_fields_are_refused_by_name(served, route, body):
    http = served[0]
    response = http.post(route, json={"model": "pymoe", "max_tokens": 2} | body)
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "unknown field" in message and "\n" not in message
    assert all(name in message for name in body if name not in ("prompt", "messages"))


def test_fields_that_change_nothing_and_nulls_pass(served):
    http, client, *_ = served
    reply = client.chat.completions.create(model="pymoe", messages=CHAT, max_tokens=2, n=2, user="u", seed=3,
                                           metadata={"k": "v"}, store=False, stream_options=None,
                                           extra_body={"some_future_field": None})
    assert len(reply.choices) == 2 and reply.usage.completion_tokens == 4
    response = http.post("/v1/completions", json={"model": "pymoe", "prompt": PROMPT, "max_tokens": 2, "suffix": None,
                                                  "user": "u", "seed": 1234})
    assert response.status_code == 200 and json.loads(response.text)["usage"]["completion_tokens"] == 2
