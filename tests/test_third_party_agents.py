"""openai-agents against a real `moeswarm serve` on the bundled model and two workers: an agent
with a function tool and a structured final answer runs its tool loop to the end, with
OpenAIChatCompletionsModel and with OpenAIResponsesModel (the Responses API), whole and streamed.
Tracing is off and nothing leaves the machine.

The first turn must call the tool (tool_choice "required": decoding is held to a call), the
agents SDK then resets tool_choice, and the final answer is held to the output type's schema. Both
model classes render the same conversation, so greedy decoding gives them the same call and the
same answer."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from pydantic import BaseModel

agents = pytest.importorskip("agents")
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,  # noqa: E402
                    function_tool, set_tracing_disabled)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

set_tracing_disabled(True)


class Answer(BaseModel):
    time: Literal["noon", "midnight"]


def _run(url: str, model_class, streamed: bool):
    """(the tool's calls, the run's result) of one agent run."""
    calls: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time now in a time zone."""
        calls.append(zone)
        return "noon"

    async def run():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        agent = Agent(name="clock", instructions="Use the tool, then answer.", tools=[get_time], output_type=Answer,
                      model=model_class(model="pymoe", openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
        if not streamed:
            return await Runner.run(agent, "What time is it in UTC?", max_turns=4)
        result = Runner.run_streamed(agent, "What time is it in UTC?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    return calls, asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_both_model_classes_run_the_tool_loop_to_a_structured_answer(trained_serve, streamed):
    outcomes = []
    for model_class in (OpenAIChatCompletionsModel, OpenAIResponsesModel):
        calls, result = _run(trained_serve.url, model_class, streamed)
        assert len(calls) == 1 and calls[0] in ("UTC", "CET"), (model_class.__name__, calls)
        kinds = [type(item) for item in result.new_items]
        assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], (model_class.__name__, kinds)
        call, output, message = result.new_items
        assert json.loads(call.raw_item.arguments) == {"zone": calls[0]} and call.raw_item.name == "get_time"
        assert output.output == "noon"
        assert isinstance(result.final_output, Answer)
        text = "".join(part.text for part in message.raw_item.content)
        assert Answer.model_validate_json(text) == result.final_output
        outcomes.append((calls[0], result.final_output))
    assert outcomes[0] == outcomes[1]  # one conversation, one greedy answer, whichever API carried it
