"""The OpenAI Agents SDK against a live slotserve, on its default Responses model and on its Chat Completions
model: a forced tool call, a typed output, and a second turn (chained by previous_response_id on Responses,
the history resent on Chat Completions). Prints one JSON object for tests/test_frameworks.py.

Runs in a virtualenv of its own (the SDK's top-level package is named `agents`, like ours), from outside the
repository:  python agents_sdk.py BASE_URL
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Literal

from openai import AsyncOpenAI
from pydantic import BaseModel

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

CALLS: list[str] = []


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    sunny: bool


@function_tool
def get_weather(city: Literal["Paris", "Oslo"]) -> str:
    """The weather in a city."""
    CALLS.append(city)
    return f"Sunny in {city}"


async def run_model(model) -> dict:
    greedy = ModelSettings(temperature=0, max_tokens=64)
    tool_agent = Agent(name="weather", instructions="You report the weather.", model=model, tools=[get_weather],
                       model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="get_weather"),
                       tool_use_behavior="stop_on_first_tool")
    called = await Runner.run(tool_agent, "What is the weather in Oslo?")
    typed_agent = Agent(name="typed", instructions="Report the weather as JSON.", model=model, output_type=Weather,
                        model_settings=greedy)
    first = await Runner.run(typed_agent, "Weather in Paris?")
    out = {"tool_output": called.final_output, "calls": list(CALLS), "typed": first.final_output.model_dump()}
    if isinstance(model, OpenAIResponsesModel):
        second = await Runner.run(typed_agent, "And in Oslo?", previous_response_id=first.last_response_id)
        out.update(first_id=first.last_response_id, second_id=second.last_response_id)
    else:
        second = await Runner.run(typed_agent, [*first.to_input_list(), {"role": "user", "content": "And in Oslo?"}])
    out["second"] = second.final_output.model_dump()
    CALLS.clear()
    # One agent with a tool and a typed output, the tool required on the first turn (the SDK resets tool_choice
    # after a call): it must call the tool, read the result and end with the typed output, not call again.
    both = Agent(name="both", instructions="Look the weather up with get_weather, then report it.", model=model,
                 tools=[get_weather], output_type=Weather,
                 model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"))
    try:
        run = await Runner.run(both, "What is the weather in Oslo?", max_turns=6)
        out["tool_then_typed"] = {"calls": list(CALLS), "typed": run.final_output.model_dump()}
    except MaxTurnsExceeded:
        out["tool_then_typed"] = {"calls": list(CALLS), "typed": None}
    CALLS.clear()
    return out


async def main(base_url: str) -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    results = {"responses": await run_model(OpenAIResponsesModel("assistant", client)),
               "chat": await run_model(OpenAIChatCompletionsModel("assistant", client))}
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
