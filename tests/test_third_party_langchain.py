"""LangChain's ChatOpenAI and litellm's tools against a real `moeswarm serve` on the bundled model
and two workers (conftest's trained_serve), as their users call them. Both send function parameters
without `additionalProperties`: the server reads them closed (serve/strict_schema.py), so the weak
bundled model's calls end whole and parse. tool_choice "auto" leaves the choice to the model (the
bundled model answers such requests in text), so the tools here are required or named.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from pydantic import BaseModel

from moeswarm.serve.strict_schema import closed

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise
langchain_openai = pytest.importorskip("langchain_openai")
litellm = pytest.importorskip("litellm")

QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # litellm's users' shape


def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


class Weather(BaseModel):
    """The weather asked about."""

    city: str
    days: int


@pytest.fixture(scope="module")
def chat(trained_serve):
    return langchain_openai.ChatOpenAI(model="pymoe", base_url=trained_serve.url + "/v1", api_key="unused",
                                       temperature=0, max_retries=0, timeout=120)


def test_langchain_bind_tools_invoke_returns_parsed_calls(chat):
    for choice in ("required", "get_weather"):
        message = chat.bind_tools([get_weather], tool_choice=choice).invoke(QUESTION)
        assert [call["name"] for call in message.tool_calls] == ["get_weather"], message
        assert set(message.tool_calls[0]["args"]) == {"city"} and isinstance(message.tool_calls[0]["args"]["city"], str)
        assert message.response_metadata["finish_reason"] == "tool_calls" and not message.invalid_tool_calls


def test_langchain_bind_tools_streamed_gives_the_same_call(chat):
    bound = chat.bind_tools([get_weather], tool_choice="required")
    whole = bound.invoke(QUESTION)
    gathered = None
    for chunk in bound.stream(QUESTION):
        gathered = chunk if gathered is None else gathered + chunk
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]


def test_langchain_with_structured_output_function_calling_returns_the_object(chat):
    answer = chat.with_structured_output(Weather, method="function_calling").invoke(QUESTION)
    assert isinstance(answer, Weather)
    assert abs(answer.days) < 10**16  # integers are bounded to 16 digits
    raw = chat.with_structured_output(Weather, method="function_calling", include_raw=True).invoke(QUESTION)
    assert raw["parsing_error"] is None and raw["parsed"] == answer


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_tools_give_parsed_calls(trained_serve, stream):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    reply = litellm.completion(model="openai/pymoe", api_base=trained_serve.url + "/v1", api_key="unused", timeout=120,
                               messages=[{"role": "user", "content": QUESTION}], tools=tools, tool_choice="required",
                               temperature=0, stream=stream)
    if stream:
        reply = litellm.stream_chunk_builder(list(reply))
    choice = reply.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and [call.function.name for call in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), closed(WEATHER))
