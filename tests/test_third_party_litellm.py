"""litellm against a real `moeswarm serve`, as its users call it: the OpenAI-compatible provider
(`model="openai/NAME"`, `api_base`) through `litellm.completion`, streamed and not, and
`litellm.text_completion`. Replies are compared with the bundled model's greedy text computed
locally; a prompt past the model's context must reach the caller as litellm's own
`ContextWindowExceededError` (serve answers in OpenAI's words, which litellm maps).
"""

from __future__ import annotations

import os

import pytest

from moeswarm.forward.stepper import Stepper
from moeswarm.serve.chat import chat_prompt

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise
litellm = pytest.importorskip("litellm")

MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def provider(trained_serve):
    """The keyword arguments that point litellm's OpenAI-compatible provider at a served swarm
    (conftest's, on the bundled model: the one lm-eval's test drives too)."""
    return {"model": "openai/pymoe", "api_base": trained_serve.url + "/v1", "api_key": "unused", "timeout": 120}


@pytest.fixture(scope="module")
def local(trained_local):
    return trained_local


def _greedy(model, codec, prompt: list[int], max_tokens: int) -> tuple[str, str]:
    """The local greedy continuation of `prompt`: (text, finish reason as OpenAI words it)."""
    stepper, tokens = Stepper(model), []
    logits = stepper.forward(prompt)[-1]
    while len(tokens) < max_tokens:
        token = int(logits.argmax())
        if token == codec.eos_token_id:
            return codec.decode(tokens), "stop"
        tokens.append(token)
        logits = stepper.forward([token])[-1]
    return codec.decode(tokens), "length"


def test_chat_completion_is_the_local_greedy_reply(provider, local):
    model, codec = local
    prompt = chat_prompt(codec, MESSAGES)
    text, finish = _greedy(model, codec, prompt, MAX_TOKENS)
    reply = litellm.completion(messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, **provider)
    choice = reply.choices[0]
    assert text and choice.message.content == text and choice.finish_reason == finish
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), MAX_TOKENS)


def test_a_streamed_chat_completion_adds_up_to_the_same_reply(provider, local):
    model, codec = local
    text, finish = _greedy(model, codec, chat_prompt(codec, MESSAGES), MAX_TOKENS)
    chunks = list(litellm.completion(messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True, **provider))
    assert len(chunks) > 2  # streamed in pieces, not one block
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason] == [finish]


def test_text_completion_is_the_local_greedy_continuation(provider, local):
    model, codec = local
    prompt = "def add(a, b):\n"
    text, _ = _greedy(model, codec, codec.encode(prompt), 8)
    reply = litellm.text_completion(prompt=prompt, max_tokens=8, temperature=0, **provider)
    assert text and reply.choices[0].text == text


def test_a_prompt_past_the_context_is_litellms_context_window_error(provider, local):
    model, codec = local
    content = "x = 1\n" * 400
    context = model.config.max_position_embeddings
    assert len(chat_prompt(codec, [{"role": "user", "content": content}])) > context
    with pytest.raises(litellm.ContextWindowExceededError, match=f"maximum context length is {context} tokens"):
        litellm.completion(messages=[{"role": "user", "content": content}], max_tokens=4, **provider)
