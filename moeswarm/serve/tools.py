"""Tool calls: what the model must write to call a function, and how its answer is read back.

A call is written as one JSON object, {"name": FUNCTION, "arguments": {...}}, on a line of its own
(the bundled model's chat template writes past calls so); an answer of one or more such lines is
a list of calls (parallel calls: several lines, unless the request says parallel_tool_calls false).
tool_choice "required" or a named function constrains decoding to such lines (the arguments
matching the function's parameters, closed as serve/strict_schema.py closes them): "required" to
1 to MAX_CALLS calls of any tool, a named function to one call of it. "auto" leaves the model free,
and an answer that is such lines is read as calls, anything else as text.

An answer cut by max_tokens while it writes a call is never passed off as text: as vLLM answers a
named tool_choice cut short, its calls come back in tool_calls (the last one with the arguments
written so far, which are not whole JSON) with finish_reason "length", and content null.
"""

from __future__ import annotations

import json
import re
import uuid

from moeswarm.serve.schemas import Tool

MAX_CALLS = 8  # calls in one answer
# the start of a call as the grammar writes it: the function's name, then its arguments so far
_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)', re.DOTALL)
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)
_CALL_OPENING, _ARGUMENTS_OPENING = '{"name":', ',"arguments":'


def call_schemas(tools: list[Tool], mode: str) -> list[dict]:
    """The JSON schemas of a call decoding is held to: one per tool ("required") or the named one's."""
    chosen = [tool for tool in tools if mode == "required" or tool.function.name == mode]
    return [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                              "arguments": tool.function.parameters},
             "required": ["name", "arguments"], "additionalProperties": False} for tool in chosen]


def most_calls(mode: str, parallel: bool | None) -> int:
    """How many calls an answer may make: one for a named function or parallel_tool_calls false."""
    return 1 if parallel is False or mode not in ("auto", "required") else MAX_CALLS


def read_calls(text: str, tools: list[Tool]) -> list[dict] | None:
    """The calls `text` makes (each {"name", "arguments": dict}) when every line of it is one call of
    one of `tools`, else None."""
    lines = [line for line in text.strip().split("\n") if line.strip()]
    calls = [_call(line, tools) for line in lines]
    return calls if calls and all(call is not None for call in calls) else None


def cut_calls(text: str, tools: list[Tool]) -> list[dict] | None:
    """The calls of an answer cut while writing them: the whole ones, then the last one's name and
    the arguments written so far (a string) once its name is whole; None when `text` is not the
    start of calls (free text)."""
    lines = text.lstrip().split("\n")
    whole = [_call(line, tools) for line in lines[:-1] if line.strip()]
    if any(call is None for call in whole):
        return None
    last = lines[-1].strip()
    cut = _CUT_CALL.match(last)
    if cut is not None and cut.group(1) in {tool.function.name for tool in tools}:
        arguments = _ARGUMENTS.match(cut.group(2))
        if arguments is not None:
            return whole + [{"name": cut.group(1), "arguments": arguments.group(1)}]
        if _ARGUMENTS_OPENING.startswith(re.sub(r"\s+", "", cut.group(2))):  # named, no arguments written yet
            return whole + [{"name": cut.group(1), "arguments": ""}]
        return None
    compact = re.sub(r"\s+", "", last)
    if compact[: len(_CALL_OPENING)] == _CALL_OPENING[: len(compact)] or compact.startswith(_CALL_OPENING + '"'):
        return whole  # the name is not whole yet: no call can be named
    return None


def answer_calls(text: str, tools: list[Tool], mode: str | None, reason: str) -> list[dict] | None:
    """The calls a chat answer makes (finish reason `reason`), or None when it is text: whole calls,
    or, cut by max_tokens, those begun (see `cut_calls`; "auto" answers only when they begin as one)."""
    if mode is None:
        return None
    calls = read_calls(text, tools)
    if calls is not None or reason != "length":
        return calls
    return cut_calls(text, tools)


def call_entry(call: dict, index: int | None = None) -> dict:
    """OpenAI's shape of one call in message.tool_calls (index: a stream delta's). arguments: a dict,
    or the text of a call cut short."""
    arguments = call["arguments"] if isinstance(call["arguments"], str) else json.dumps(call["arguments"], ensure_ascii=False)
    entry = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": arguments}}
    return entry if index is None else {"index": index} | entry


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates take them (transformers' apply_chat_template(tools=...))."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _call(line: str, tools: list[Tool]) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    names = {tool.function.name for tool in tools}
    if (not isinstance(value, dict) or set(value) != {"name", "arguments"} or value["name"] not in names
            or not isinstance(value["arguments"], dict)):
        return None
    return value
