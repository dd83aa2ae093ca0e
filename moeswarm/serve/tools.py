"""Tool calls: what the model must write to call a function, and how its answer is read back.

A call is written as one JSON object, {"name": FUNCTION, "arguments": {...}}: the whole answer.
tool_choice "required" or a named function constrains decoding to such an object (the arguments
matching the function's parameters schema), so the answer is always a call; "auto" leaves the
model free, and an answer that is such an object is read as a call, anything else as text.
"""

from __future__ import annotations

import json
import uuid

from moeswarm.serve.schemas import Tool


def call_schema(tools: list[Tool], mode: str) -> dict | None:
    """The JSON schema decoding is held to: None for "auto" (free), else a call of one of the tools
    ("required") or of the named one."""
    if mode == "auto":
        return None
    chosen = [tool for tool in tools if mode == "required" or tool.function.name == mode]
    calls = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                              "arguments": tool.function.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in chosen]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def read_call(text: str, tools: list[Tool]) -> dict | None:
    """The call `text` makes ({"name", "arguments"}) when it is one object naming one of `tools`, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    names = {tool.function.name for tool in tools}
    if (not isinstance(value, dict) or set(value) != {"name", "arguments"} or value["name"] not in names
            or not isinstance(value["arguments"], dict)):
        return None
    return value


def call_entry(call: dict, index: int | None = None) -> dict:
    """OpenAI's shape of one call in message.tool_calls (index: a stream delta's)."""
    entry = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
    return entry if index is None else {"index": index} | entry


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates take them (transformers' apply_chat_template(tools=...))."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
