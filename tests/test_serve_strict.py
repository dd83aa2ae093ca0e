"""Structured output as the strict implementations behave: schemas closed and bounded
(serve/strict_schema.py), tool calls whole, parallel or cut by max_tokens (serve/tools.py), and
pathological schemas refused in one line. The bundled model in-process (local mode) answers.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from inprocess_serve import in_process_serve

from moeswarm.bundled import TRAINED
from moeswarm.serve.grammar import Grammars
from moeswarm.serve.strict_schema import INTEGER_BOUND, MAX_DEPTH, STRING_CHARS, closed

ASK = [{"role": "user", "content": "what is the weather in Paris?"}]
OPEN = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}  # as LangChain and litellm send it: no additionalProperties
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.", "parameters": OPEN}}


@pytest.fixture(scope="module")
def served():
    with in_process_serve(str(TRAINED), "pymoe") as (http, client, engine):
        yield http, client, engine.codec


def test_closed_closes_objects_and_bounds_integers_and_strings_keeping_what_the_schema_says():
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}},
        "b": {"type": "object", "properties": {}, "additionalProperties": True},
        "c": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "string", "pattern": "^x+$"}, {"type": "string"}]}},
        "$defs": {"d": {"type": "integer", "exclusiveMaximum": 5}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["b"]["additionalProperties"] is True
    item = out["properties"]["a"]["items"]
    assert item["additionalProperties"] is False and item["properties"]["n"] == {"type": "number", "minimum": 0,
                                                                                   "maximum": INTEGER_BOUND}
    assert [s.get("maxLength") for s in out["properties"]["c"]["anyOf"]] == [3, None, STRING_CHARS]
    assert out["$defs"]["d"] == {"type": "integer", "exclusiveMaximum": 5, "minimum": -INTEGER_BOUND}
    assert "additionalProperties" not in schema  # the request's own schema is not changed


def test_the_grammar_bounds_integers_to_16_digits_and_closes_objects(served):
    codec = served[2]
    grammars = Grammars(codec.tokenizer, 4096)
    grammar = grammars.json_schema(OPEN)

    def accepts(text: str) -> bool:
        tokens = codec.encode(text)
        return grammars.constraint(grammar).valid_drafts(tokens) == tokens

    assert accepts('{"city":"Paris","days":' + "9" * 16 + "}") and not accepts('{"city":"Paris","days":' + "9" * 17)
    assert not accepts('{"city":"Paris","days":1,"x"')
    assert accepts('{"city":"' + "a" * STRING_CHARS + '"') and not accepts('{"city":"' + "a" * (STRING_CHARS + 1))


def test_a_strict_schema_without_additional_properties_gives_a_closed_object(served):
    client = served[1]
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": OPEN}}
    reply = client.chat.completions.create(model="pymoe", messages=ASK, temperature=0, response_format=response_format)
    value = json.loads(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop" and set(value) == {"city", "days"}
    jsonschema.validate(value, closed(OPEN))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_calls_of_open_parameters_end_whole(served, tool_choice):
    client = served[1]
    reply = client.chat.completions.create(model="pymoe", messages=ASK, temperature=0, tools=[TOOL], tool_choice=tool_choice)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), closed(OPEN))


@pytest.mark.parametrize("max_tokens, named", [(18, True), (3, False)])
def test_a_call_cut_by_max_tokens_ends_with_length_and_is_never_content(served, max_tokens, named):
    """18 tokens: the name is written, the arguments so far come back as the call's; 3: not even the name."""
    client = served[1]
    whole = client.chat.completions.create(model="pymoe", messages=ASK, temperature=0, tools=[TOOL],
                                           tool_choice="required", max_tokens=max_tokens)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    if named:
        assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1].startswith("{")
    else:
        assert calls == []
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model="pymoe", messages=ASK, temperature=0, tools=[TOOL], tool_choice="required", max_tokens=max_tokens,
        stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    assert [(d.function.name, d.function.arguments) for c in chunks for d in c.delta.tool_calls or ()] == calls
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]


def test_required_allows_parallel_calls_and_a_named_function_one(served):
    codec = served[2]
    grammars = Grammars(codec.tokenizer, 4096)
    one = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": closed(OPEN)},
           "required": ["name", "arguments"]}
    call = '{"name":"f","arguments":{"city":"Rome","days":2}}'
    for most, allowed in ((3, 3), (1, 1)):
        grammar = grammars.calls([one], most)
        text = "\n".join([call] * 4)
        tokens = codec.encode(text)
        kept = codec.decode(grammars.constraint(grammar).valid_drafts(tokens))
        assert kept.count('"name"') == allowed and kept.startswith("\n".join([call] * allowed))


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("schema, words", [
    (_deep(MAX_DEPTH + 5), f"more than {MAX_DEPTH} levels"),
    ({"enum": [f"v{i}" for i in range(20_000)]}, "more than"),
    ({"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "description": "x" * 200}
                                                 for i in range(j, j + 20)}} for j in range(100)]}, "characters of JSON"),
    ({"type": "string", "pattern": "(a|b"}, "regex"),
    ({"$ref": "#/$defs/nope"}, "nope"),
    ({"type": "string", "format": "no-such-format"}, "format"),
])
def test_pathological_schemas_are_400s_in_one_line(served, schema, words):
    http = served[0]
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                 {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}], "tool_choice": "required"}):
        response = http.post("/v1/chat/completions", json={"model": "pymoe", "messages": ASK, "max_tokens": 4} | body)
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and words in message, message
        assert "\n" not in message and len(message) < 400
