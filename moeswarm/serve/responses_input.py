"""The Responses API's request (POST /v1/responses), and its input as the chat messages a chat
template renders.

The subset built is the one agent frameworks (openai-agents) use: `input` as a text or a list of
items (messages with text content, `function_call` and `function_call_output` items),
`instructions` (a system message first), function `tools` and `tool_choice`, `text.format`
(structured output), `max_output_tokens`, `temperature`, `top_p`, `stream`, `store` and
`previous_response_id`, `parallel_tool_calls` (false: one call per answer). Fields that change
nothing here (`metadata`, `user`, `service_tier`, ...) are accepted; any other field, and any other item, part or tool type, is a
400 naming it.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from moeswarm.errors import printable
from moeswarm.serve.schemas import FunctionSpec, NamedFunction, NamedToolChoice, ResponseFormat, Tool, _check_text

MAX_ITEMS = 1024  # input items per request
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    input: StrictStr | list[dict] = Field(min_length=1)
    instructions: StrictStr | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    text: dict | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)  # not OpenAI's: as the other routes take it
    stream: StrictBool = False
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    metadata: dict | None = None
    user: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call per answer (serve/tools.py)
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    include: list[StrictStr] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict | None = None
    background: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    stream_options: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"{printable(unknown[0], 64)}: not a field of the Responses API this server "
                                 f"implements ({printable(', '.join(unknown), 200)})")
        return _check_text(data)

    @model_validator(mode="after")
    def _supported(self):
        if self.include:
            raise ValueError(f"include: {printable(self.include[0], 64)} is not supported by this server")
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            raise ValueError("reasoning: this model does not reason; leave reasoning out")
        self.function_tools()  # checked here: a 400 naming the field
        self.tool_mode()
        self.response_format()
        return self

    def function_tools(self) -> list[Tool]:
        """The function tools as chat's Tool (Responses' flat shape: {type, name, description, parameters, strict})."""
        tools = []
        for index, given in enumerate(self.tools or ()):
            kind = given.get("type")
            if kind != "function":
                raise ValueError(f"tools[{index}]: {printable(str(kind), 64)} tools are not supported by this "
                                 "server (function tools only)")
            spec = {key: value for key, value in given.items() if key != "type" and value is not None}
            tools.append(Tool(type="function", function=FunctionSpec.model_validate(spec)))
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools with one name")
        return tools

    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice none), "auto", "required", or the name of the function to call."""
        names = [tool.function.name for tool in self.function_tools()]
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError("tool_choice: none, auto, required or {\"type\": \"function\", \"name\": ...}")
            NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
            if choice["name"] not in names:
                raise ValueError(f"tool_choice: no tool is named {printable(choice['name'], 64)!r}")
            return choice["name"]
        if not names or choice == "none":
            return None
        return choice or "auto"

    def response_format(self) -> ResponseFormat | None:
        """text.format as chat's response_format (Responses' flat json_schema: {type, name, schema, strict})."""
        given = (self.text or {}).get("format")
        if given is None:
            return None
        if not isinstance(given, dict):
            raise ValueError("text.format: an object {type: text | json_object | json_schema, ...}")
        if given.get("type") == "json_schema":
            inner = {key: given[key] for key in ("name", "schema", "strict") if key in given}
            return ResponseFormat(type="json_schema", json_schema=inner)
        return ResponseFormat(type=given.get("type", "text"))


def chat_messages(input: str | list[dict], instructions: str | None = None) -> list[dict]:
    """The input as chat messages ({role, content[, tool_calls | tool_call_id]}), instructions first.
    ValueError naming the item for anything else than text messages and function call items."""
    items = [{"role": "user", "content": input}] if isinstance(input, str) else input
    if len(items) > MAX_ITEMS:
        raise ValueError(f"input: at most {MAX_ITEMS} items")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: an item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            _arguments(call["function"]["arguments"], where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": content})
        else:
            raise ValueError(f"{where}: items of type {printable(str(kind), 64)} are not supported by this server "
                             "(messages, function_call and function_call_output only)")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ValueError(f"{where}.role: user, system, developer or assistant")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts_text(parts, where: str) -> str:
    if not isinstance(parts, list):
        raise ValueError(f"{where}: a text or a list of text parts")
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise ValueError(f"{where}[{index}]: parts of type {printable(str(kind), 64)} are not supported by "
                             "this server (text only)")
    return "".join(texts)


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key}: a non-empty string")
    return value


def _arguments(arguments: str, where: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        raise ValueError(f"{where}.arguments: not JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}.arguments: a JSON object")
